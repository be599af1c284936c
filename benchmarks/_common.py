"""Helpers shared by the benchmark scripts: machine facts, the dtype, real token batches, fair timing, JSON.

Timings on a small shared CPU are noisy. Every benchmark therefore times the things it compares
in the same run, interleaved round by round, and reports the median (and best) per call, so a
burst of load from another process hits both sides alike.

The dtype defaults to "auto" as in training (optimus.train.precision): bf16 only where the device
computes it natively. A benchmark that compares dtypes compares those native here unless told
otherwise: an emulated bf16 (about a hundred times slower on an AVX2-only CPU) measures nothing
worth a figure.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from optimus.cli.errors import stop_writing_to_a_closed_pipe
from optimus.parallel.launch import cpu_speed_cache
from optimus.train.hardware import best_matmul_rate, cpu_model, cpu_speed
from optimus.train.precision import Precision, choose_precision


def run_script(main: Callable[[], int | None]) -> None:
    """A benchmark's entry point: exits with main's code, and quietly (141) where the reader of its table went away
    (`python benchmarks/plan_here_stored.py | head`), as `optimus` does."""
    try:
        code = main()
    except BrokenPipeError:
        code = stop_writing_to_a_closed_pipe()
    sys.exit(code)


def machine_info() -> dict:
    """Date, machine and library versions to store next to every figure."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_model()} ({platform.machine()})",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def real_token_batches(
    n_batches: int, batch: int, seq_len: int, corpus: str = "sotu", tokenizer: str = "olmoe"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n_batches` (inputs, labels) pairs [batch, seq_len] of real text, documents joined by EOS.

    Real tokens rather than random ids: the router's load (hence the expert matmul shapes) and
    the loss depend on the token distribution.
    """
    from optimus.data.sources import iter_packaged_documents, load_tokenizer

    tok = load_tokenizer(tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    need = n_batches * batch * (seq_len + 1)
    ids: list[int] = []
    for doc in iter_packaged_documents(corpus):
        ids.extend(tok.encode(doc).ids)
        if eos is not None:
            ids.append(eos)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise RuntimeError(f"corpus '{corpus}' has {len(ids)} tokens, {need} needed")
    rows = torch.tensor(ids[:need], dtype=torch.long).view(n_batches, batch, seq_len + 1)
    return [(rows[i, :, :-1].contiguous(), rows[i, :, 1:].contiguous()) for i in range(n_batches)]


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    calls_per_round: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, dict[str, float]]:
    """Seconds per call of each fn: {name: {"median", "best"}}, the fns alternating round by round.

    `clock=time.process_time` with one thread measures CPU time, which other processes on a
    shared machine barely disturb (with more threads it would add up the threads' times).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        # Alternate the order too, so neither side always runs right after the other.
        names = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in names:
            for _ in range(calls_per_round):
                start = clock()
                fns[name]()
                samples[name].append(clock() - start)
    return {name: {"median": statistics.median(s), "best": min(s)} for name, s in samples.items()}


CPU_TIME_HELP = "CPU only: one thread, timed by process CPU time (steadier on a busy shared machine)"


def timing_clock(cpu_time: bool, device: torch.device, parser: argparse.ArgumentParser) -> Callable[[], float]:
    """The clock a benchmark times with: the wall clock, or with --cpu-time (CPU runs only) the
    process CPU time of a single thread, which other processes on the machine barely disturb."""
    if not cpu_time:
        return time.perf_counter
    if device.type != "cpu":
        parser.error("--cpu-time times CPU work only: use it with --device cpu")
    torch.set_num_threads(1)
    return time.process_time


def choose_dtype(requested: str, device: torch.device) -> Precision:
    """`--dtype` ("auto", "fp32", "bf16") resolved for `device` as training resolves train.dtype.

    On CPU the measured matmul rates come from the per-machine cache the trainer uses (the first
    run on a machine probes for about 2 s).
    """
    cpu = None
    if device.type == "cpu":
        cpu = cpu_speed(*cpu_speed_cache())
    return choose_precision(requested, device, cpu)


DTYPES_HELP = "comma list of fp32, bf16; auto (default): fp32, and bf16 where the device computes it natively"


def dtype_list(text: str) -> str:
    """argparse type of --dtypes: "auto", or a comma list of distinct fp32 and bf16 (returned as given)."""
    names = text.split(",")
    if text != "auto" and (any(n not in ("fp32", "bf16") for n in names) or len(set(names)) != len(names)):
        raise argparse.ArgumentTypeError(f"{text!r}: give auto, or a comma list of fp32 and bf16")
    return text


def dtypes_to_compare(requested: str, device: torch.device) -> list[Precision]:
    """`--dtypes` resolved: "auto" is fp32 and, where the device computes it natively, bf16;
    an explicit list ("fp32,bf16") runs every dtype named, bf16 with choose_precision's warning
    where it is emulated."""
    if requested != "auto":
        return [choose_dtype(name, device) for name in requested.split(",")]
    auto = choose_dtype("auto", device)
    if auto.dtype == "fp32":
        return [auto]  # no native bf16: its reason says why bf16 is left out
    return [Precision("fp32", "auto", "fp32 is compared on every device"), auto]


def emulated_bf16(precision: Precision) -> bool:
    """Whether `precision` is a bf16 the device only emulates (choose_precision warns exactly then)."""
    return precision.dtype == "bf16" and precision.warning is not None


def precision_fields(precision: Precision) -> dict[str, str]:
    """The dtype, what was asked for and why, as every benchmark's JSON names them."""
    return {"dtype": precision.dtype, "dtype_requested": precision.requested, "dtype_reason": precision.reason}


def announce(precision: Precision) -> str:
    """Print the dtype line (stdout) and choose_precision's warning if any (stderr); returns the line."""
    line = f"dtype {precision.dtype} (--dtype {precision.requested}: {precision.reason})"
    print(line, flush=True)
    if precision.warning:
        print(precision.warning, file=sys.stderr, flush=True)
    return line


def cpu_matmul_peak(precision: Precision, size: int = 2048, seconds: float = 1.0) -> tuple[float, str]:
    """(best FLOP/s of a square CPU matmul measured now, which matmul) for `precision`.

    An emulated bf16 is read against the fp32 rate, the most this CPU can do (as
    optimus.train.hardware.device_peak_flops does); probing it at this size would take minutes.
    """
    dtype = "fp32" if emulated_bf16(precision) else precision.dtype
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    what = f"{dtype} matmul" + (" (bf16 is emulated here)" if dtype != precision.dtype else "")
    return best_matmul_rate(torch_dtype, size, seconds), what


def write_json(path: str | Path, payload: dict) -> None:
    """Write `payload` as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


# collective -> (position, keyword) of the tensor whose bytes it moves (all_gather_into_tensor and
# reduce_scatter_tensor call the *_single ones inside c10d, so they are counted too)
WRAPPED = {
    "all_gather_single": (0, "output_tensor"), "reduce_scatter_single": (1, "input"),
    "all_to_all_single": (1, "input"), "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"),
    "send": (0, "tensor"), "recv": (0, "tensor"),
}


class CollectiveCounter:
    """Counts calls and bytes per collective, by wrapping torch.distributed's functions in place."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.active = False

    def install(self) -> None:
        for name, where in WRAPPED.items():
            original = getattr(c10d, name)
            wrapper = self._wrap(name, where, original)
            setattr(c10d, name, wrapper)  # the callers inside c10d (all_gather_into_tensor, ...)
            setattr(dist, name, wrapper)  # and those that call dist.<name>

    def _wrap(self, name, where, original):
        position, keyword = where

        def counted(*args, **kwargs):
            if self.active:
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                if dist.get_world_size(group) > 1:
                    tensor = args[position] if len(args) > position else kwargs[keyword]
                    self.bytes[name] += tensor.numel() * tensor.element_size()
                    self.calls[name] += 1
            return original(*args, **kwargs)

        return counted


def ep_all_to_all_bytes(moe_layers: int, tokens: int, top_k: int, d_model: int, n_experts: int) -> int:
    """EP's all_to_all bytes per rank for one micro-batch of `tokens` tokens (fp32): per MoE layer the
    [tokens * top_k, d_model] token copies go out and back in forward, their gradients in backward (4
    exchanges), plus the [n_experts] int64 counts."""
    return moe_layers * (4 * tokens * top_k * d_model * 4 + n_experts * 8)


# published step-time predictors' mean absolute errors (REFERENCE.md, "Published accuracy of training-performance
# predictors"): GPU clusters, not this script's machine, so a yardstick rather than a like-for-like comparison
PUBLISHED_PREDICTOR_ERRORS = ("vTrain 8.37% on one 8-GPU node (14.73% multi-node), AMPeD at most 12%, "
                              "arXiv 2509.22832 4.98% (A100) / 9.38% (GH200), Proteus 3.0%")


def prediction_accuracy(step_errors: list[float]) -> str:
    """One line: the mean absolute and the largest relative step-time error, beside the published predictors'."""
    if not step_errors:
        return "no step times compared"
    mean = statistics.fmean(abs(e) for e in step_errors)
    return (f"step time: mean absolute error {mean:.1%}, largest {max(abs(e) for e in step_errors):.1%} over "
            f"{len(step_errors)} (published predictors' mean absolute errors: {PUBLISHED_PREDICTOR_ERRORS})")
