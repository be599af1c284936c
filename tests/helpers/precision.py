"""What train.dtype=auto trains in on this machine's CPU (tests that only make sense where bf16 is native)."""

from __future__ import annotations


def cpu_auto_dtype() -> str:
    """"bf16" where this CPU computes bf16 natively, else "fp32" (the trainer's choice, from its cached probe)."""
    import torch

    from optimus.parallel.launch import cpu_speed_cache
    from optimus.train.hardware import cpu_speed
    from optimus.train.precision import choose_precision

    return choose_precision("auto", torch.device("cpu"), cpu_speed(*cpu_speed_cache())).dtype
