"""train.dtype=auto: bf16 only where the device computes it natively; an explicit bf16 elsewhere warns."""

from __future__ import annotations

import pytest
import torch

from optimus.train import precision as precision_module
from optimus.train.hardware import CpuSpeed, best_matmul_rate, cpu_speed
from optimus.train.precision import choose_precision, native_bf16

CPU = torch.device("cpu")
AVX2_ONLY = CpuSpeed(fp32_flops=120e9, bf16_flops=0.9e9, capability="AVX2", bf16_flags=False)
SAPPHIRE_RAPIDS = CpuSpeed(fp32_flops=170e9, bf16_flops=400e9, capability="AVX512", bf16_flags=True)
# flags say bf16 but oneDNN was capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2): the probe shows the truth
FLAGS_BUT_CAPPED = CpuSpeed(fp32_flops=58e9, bf16_flags=True, bf16_flops=0.9e9, capability="AVX2")


def test_auto_is_fp32_on_a_cpu_without_native_bf16():
    chosen = choose_precision("auto", CPU, AVX2_ONLY)
    assert chosen.dtype == "fp32" and chosen.warning is None
    assert "no native bf16" in chosen.reason and "AVX2" in chosen.reason
    assert chosen.describe().startswith("precision: fp32 (train.dtype=auto; ")


def test_auto_is_bf16_on_a_cpu_with_fast_native_bf16():
    chosen = choose_precision("auto", CPU, SAPPHIRE_RAPIDS)
    assert chosen.dtype == "bf16" and chosen.warning is None


def test_flags_alone_do_not_make_bf16_native_when_the_probe_says_it_is_slow():
    assert native_bf16(CPU, FLAGS_BUT_CAPPED)[0] is False
    assert choose_precision("auto", CPU, FLAGS_BUT_CAPPED).dtype == "fp32"


def test_explicit_bf16_without_native_support_runs_with_one_warning_stating_the_slowdown():
    chosen = choose_precision("bf16", CPU, AVX2_ONLY)
    assert chosen.dtype == "bf16"
    assert chosen.warning is not None and "\n" not in chosen.warning
    assert "133x slower than fp32" in chosen.warning and "train.dtype=auto" in chosen.warning


def test_explicit_fp32_is_kept_everywhere():
    assert choose_precision("fp32", CPU, SAPPHIRE_RAPIDS).dtype == "fp32"


@pytest.mark.parametrize("capability, expected", [((7, 0), "fp32"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_cuda_bf16_follows_compute_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(precision_module.torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    chosen = choose_precision("auto", torch.device("cuda", 0))
    assert chosen.dtype == expected and f"compute capability {capability[0]}.{capability[1]}" in chosen.reason


@pytest.mark.parametrize("arch, expected", [("gfx908", "fp32"), ("gfx90a:sramecc+:xnack-", "bf16"), ("gfx942", "bf16")])
def test_rocm_bf16_from_mi200_on(monkeypatch, arch, expected):
    class Properties:
        gcnArchName = arch

    monkeypatch.setattr(precision_module.torch.version, "hip", "6.2")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "AMD Instinct")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Properties())
    assert choose_precision("auto", torch.device("cuda", 0)).dtype == expected


def test_the_probe_on_this_cpu_agrees_with_its_measured_rates():
    """Whatever CPU this runs on: auto is bf16 exactly when bf16 matmuls are not slower than fp32."""
    speed = cpu_speed(cache_file=None)
    chosen = choose_precision("auto", CPU, speed)
    assert chosen.dtype == ("bf16" if speed.bf16_flags and speed.bf16_flops >= speed.fp32_flops else "fp32")
    assert speed.fp32_flops >= 1e9 * torch.get_num_threads()  # the sanity floor
    assert best_matmul_rate(torch.float32, 64, 0.0, min_repeats=1) > 0


def test_bf16_as_fast_as_fp32_counts_as_native():
    """"Not slower than fp32": a CPU with the bf16 units whose bf16 matmul rate equals its fp32 rate trains in bf16."""
    even = CpuSpeed(fp32_flops=150e9, bf16_flops=150e9, capability="AVX512", bf16_flags=True)
    assert native_bf16(CPU, even)[0] is True
    assert choose_precision("auto", CPU, even).dtype == "bf16"


def test_a_fast_bf16_rate_without_the_bf16_units_is_not_native():
    """The rate alone does not make bf16 native: without AVX512-BF16 or AMX (a probe that met a busy fp32 run, or
    an emulation that caught up on a tiny matmul) auto stays fp32, where a real run would emulate bf16."""
    no_units = CpuSpeed(fp32_flops=100e9, bf16_flops=120e9, capability="AVX2", bf16_flags=False)
    assert native_bf16(CPU, no_units)[0] is False
    assert choose_precision("auto", CPU, no_units).dtype == "fp32"


def test_an_xpu_is_bf16_unless_its_runtime_says_otherwise(monkeypatch):
    """Intel's data-center GPUs have bf16 matrix units: a torch whose xpu module cannot say (no
    is_bf16_supported) trains in bf16 there; one that says no trains in fp32."""
    import types

    name = "Intel(R) Data Center GPU Max 1550"
    monkeypatch.setattr(torch, "xpu", types.SimpleNamespace(get_device_name=lambda device=None: name))
    chosen = choose_precision("auto", torch.device("xpu", 0))
    assert chosen.dtype == "bf16" and name in chosen.reason
    monkeypatch.setattr(torch, "xpu", types.SimpleNamespace(get_device_name=lambda device=None: name,
                                                            is_bf16_supported=lambda: False))
    assert choose_precision("auto", torch.device("xpu", 0)).dtype == "fp32"


def _as_rank_of_two(monkeypatch, rank: int, rank_0_reads_bf16: bool) -> None:
    """torch.distributed as one rank of two sees it: its broadcast hands back rank 0's reading."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src=0, **kwargs: tensor.fill_(int(rank_0_reads_bf16)))


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("speed", [SAPPHIRE_RAPIDS, AVX2_ONLY], ids=["bf16", "fp32"])
def test_a_rank_that_reads_auto_as_rank_0_does_keeps_its_own_reading(monkeypatch, rank, speed):
    """Where this rank's reading of auto is rank 0's, nothing is overridden: same dtype, its own reason, and no
    warning (a bf16 rank that has the units is not told it emulates them)."""
    from optimus.train.precision import agree_on_precision

    own = choose_precision("auto", CPU, speed)
    _as_rank_of_two(monkeypatch, rank, rank_0_reads_bf16=own.dtype == "bf16")
    assert agree_on_precision(own, CPU) == own
