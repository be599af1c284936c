"""Helpers shared by the benchmark scripts: machine facts, real token batches, fair timing, JSON.

Timings on a small shared CPU are noisy. Every benchmark therefore times the things it compares
in the same run, interleaved round by round, and reports the median (and best) per call, so a
burst of load from another process hits both sides alike.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def write_json(path: str | Path, payload: dict) -> None:
    """Write `payload` as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
