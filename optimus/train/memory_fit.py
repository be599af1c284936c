"""Before the model is built: does the layout fit the memory this rank has?

A layout that cannot fit used to be found out by the kernel's OOM killer or a CUDA out-of-memory error minutes into
the run (`train.global_batch_size=100000000` derives a micro-batch of 10^8 sequences). The planner's memory model
(optimus/plan/memory.py: parameters, gradients, optimizer state for the shard mode, activations under the
checkpointing mode and schedule, FSDP and bucket transients) predicts each rank's peak within about 10% of the
allocator's (BENCHMARKS.md, "Planner vs measured here"); the run is refused when that peak alone exceeds what the rank
can have: the device's free memory, or on a CPU the node's available memory (the cgroup's limit where lower) shared
by the ranks on the node. Only a clear excess is refused: the process's own footprint (torch, the data's pages,
kernel caches) is not counted, so a run that passes can still be tight.
"""

from __future__ import annotations

from pathlib import Path

import torch

from optimus.checkpoint.preflight import human_bytes
from optimus.config import Config
from optimus.parallel.mesh import LayoutError, ParallelDims


class MemoryFitError(LayoutError):
    """The layout's predicted peak exceeds the memory this rank has (one line, with the fix)."""


def predicted_peak_bytes(config: Config, dims: ParallelDims, device: torch.device) -> float:
    """The planner's per-rank peak for this run's config (validated, micro-batch resolved, dtype resolved)."""
    from optimus.plan.memory import ModelShape, peak_memory

    return peak_memory(config, dims, ModelShape.of(config), loss_on_cpu=device.type == "cpu")


def available_bytes(device: torch.device, ranks_on_node: int) -> float | None:
    """Memory one rank of this node can have: an accelerator's free memory, or the host's available memory shared by
    the node's ranks; None where it cannot be read."""
    if device.type == "cpu":
        host = _host_available_bytes()
        return None if host is None else host / max(ranks_on_node, 1)
    accelerator = getattr(torch, device.type, None)
    mem_get_info = getattr(accelerator, "mem_get_info", None)
    if mem_get_info is None:
        return None
    try:
        free, _total = mem_get_info(device)
    except (RuntimeError, AssertionError):  # a backend that cannot tell
        return None
    return float(free)


def _host_available_bytes(root: Path = Path("/")) -> float | None:
    """MemAvailable from /proc/meminfo, or the cgroup's remaining limit where that is lower (a batch job's share);
    `root`: where /proc and /sys are (tests)."""
    try:
        meminfo = (root / "proc/meminfo").read_text()
    except OSError:
        return None
    available = next((float(line.split()[1]) * 1024 for line in meminfo.splitlines()
                      if line.startswith("MemAvailable:")), None)
    if available is None:
        return None
    for limit_file, usage_file in (("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),  # cgroup v2
                                   ("sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
                                    "sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = (root / limit_file).read_text().strip(), (root / usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit():  # "max" (v2) means no limit
            available = min(available, float(max(int(limit) - int(usage), 0)))
        break
    return available


def check_memory_fits(config: Config, dims: ParallelDims, device: torch.device, ranks_on_node: int) -> float:
    """The predicted peak per rank in bytes; MemoryFitError when it exceeds what this rank can have."""
    predicted = predicted_peak_bytes(config, dims, device)
    available = available_bytes(device, ranks_on_node)
    if available is None or predicted <= available:
        return predicted
    where = (f"{device.type} memory free on this device" if device.type != "cpu" else
             f"host memory available per rank ({ranks_on_node} rank(s) on this node)")
    raise MemoryFitError(
        f"this layout needs about {human_bytes(predicted)} per rank at its peak (optimus/plan/memory.py; "
        f"`optimus plan` shows the terms), but only {human_bytes(available)} of {where}: "
        f"{_fix(config, dims, device, available)}; or set train.memory_check=false to try anyway")


def _fix(config: Config, dims: ParallelDims, device: torch.device, available: float) -> str:
    """What to change: the largest micro-batch that fits when there is one (without pipeline parallelism, whose
    schedules constrain it), else the memory knobs."""
    micro = config.train.micro_batch_size or 1
    if dims.pp == 1 and micro > 1:
        per_rank = config.train.global_batch_size // dims.dp
        smaller = _largest_fitting(_micro_batches_below(per_rank, micro),
                                   lambda m: predicted_peak_bytes(_with_micro_batch(config, m), dims, device) <= available)
        if smaller is not None:
            return f"set train.micro_batch_size={smaller} (accumulating {per_rank // smaller} micro-batches a step)"
    knobs = ["lower train.micro_batch_size or train.seq_len"] if micro > 1 else ["lower train.seq_len"]
    if config.train.activation_checkpointing != "full":
        knobs.append("set train.activation_checkpointing=full")
    knobs.append("shard over more ranks (parallel.dp_shard, tp, pp, ep)")
    return ", ".join(knobs)


def _with_micro_batch(config: Config, micro: int) -> Config:
    return config.model_copy(update={"train": config.train.model_copy(update={"micro_batch_size": micro})})


def _micro_batches_below(per_rank: int, micro: int) -> list[int]:
    """The micro-batches a rank's share can be cut into (its divisors) below `micro`, smallest first; none for a
    share too large to factor quickly (past 10^10 sequences: no suggestion then)."""
    if per_rank > 10**10:
        return []
    divisors = {d for i in range(1, int(per_rank ** 0.5) + 1) if per_rank % i == 0 for d in (i, per_rank // i)}
    return sorted(d for d in divisors if d < micro)


def _largest_fitting(candidates: list[int], fits) -> int | None:
    """The largest candidate that fits, or None: a binary search, as the peak grows with the micro-batch among
    micro-batches that accumulate (every candidate is below the rank's share; one micro-batch a step can peak lower
    than two half its size, whose gradients are whole beside the activations)."""
    low, high, best = 0, len(candidates) - 1, None
    while low <= high:
        middle = (low + high) // 2
        if fits(candidates[middle]):
            best, low = candidates[middle], middle + 1
        else:
            high = middle - 1
    return best
