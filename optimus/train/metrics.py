"""Throughput, MFU and router-load figures for the training log.

Tokens per second are counted twice, under distinct names: `tokens_per_s` is the whole job's
(every data-parallel replica's tokens), `tokens_per_s_per_device` that divided by the devices
that computed them (tp x pp x ... ranks share one replica's tokens). MFU is per device: model
FLOPs one device did per second over that device's peak (optimus.train.hardware). An MFU above
100% means the peak is wrong; it is then reported as missing, with one warning, rather than shown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ThroughputReport:
    tokens_per_s: float  # the whole job
    tokens_per_s_per_device: float
    mfu: float | None  # None when the figure exceeds 100%: the peak it was read against is too low
    impossible_mfu: float | None = None  # the >100% figure, for the one warning that says so


class Throughput:
    """Tokens/s and MFU over the steps since the last report.

    add() takes this rank's data-parallel replica's tokens; `replicas` is the number of
    data-parallel replicas and `world_size` the number of devices, so a tp=2 job counts each
    replica's tokens once but spreads their FLOPs over two devices.
    """

    def __init__(self, flops_per_token: float, peak_flops: float, replicas: int = 1, world_size: int = 1):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.replicas = replicas
        self.world_size = world_size
        self._tokens = 0
        self._start = time.perf_counter()

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def report(self) -> ThroughputReport:
        """Throughput since the previous report; resets the window."""
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        global_tokens_per_s = self._tokens * self.replicas / elapsed
        self._tokens, self._start = 0, time.perf_counter()
        per_device = global_tokens_per_s / self.world_size
        mfu = per_device * self.flops_per_token / self.peak_flops
        if mfu > 1.0:
            return ThroughputReport(global_tokens_per_s, per_device, None, mfu)
        return ThroughputReport(global_tokens_per_s, per_device, mfu)


def expert_load_summary(expert_counts: torch.Tensor) -> dict[str, float]:
    """Max and min expert load relative to a perfectly even split, over all MoE layers [L, E]."""
    counts = expert_counts.to(torch.float64)
    even = counts.sum(dim=1, keepdim=True) / counts.shape[1]
    relative = counts / even.clamp(min=1e-9)
    return {"expert_load_max": relative.max().item(), "expert_load_min": relative.min().item()}


def busiest_block_share(expert_counts: torch.Tensor, blocks: int) -> torch.Tensor:
    """Per MoE layer ([L] from counts [L, E]; [..., L] from [..., L, E], e.g. a run's logged steps): the token
    copies routed to the busiest of `blocks` contiguous blocks of experts over an even split's share (1.0 where a
    layer routed none). The ranks that split the experts own such blocks (rank (ep i, tp t) the block i x tp + t:
    parallel/expert_tensor_parallel.py), and each layer's exchange or tensor-parallel sum waits for the busiest;
    `optimus plan --moe-imbalance` prices that share."""
    counts = expert_counts.to(torch.float64)
    experts = counts.shape[-1]
    if experts % blocks:
        raise ValueError(f"{experts} experts do not split into {blocks} equal blocks")
    per_block = counts.unflatten(-1, (blocks, experts // blocks)).sum(dim=-1)
    total = counts.sum(dim=-1)
    return torch.where(total > 0, per_block.amax(dim=-1) * blocks / total.clamp(min=1e-9), 1.0)


def expert_counts_record(expert_counts: torch.Tensor) -> list[list[int]]:
    """Tokens routed to each expert of each MoE layer ([layers][experts] ints) for a metrics record."""
    return expert_counts.detach().round().long().cpu().tolist()


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(the most memory this process has held so far, what was measured).

    On an accelerator, the allocator's peak (max_memory_allocated: tensors, not the cache around them);
    on CPU, the process's peak resident set size.
    """
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(backend, "max_memory_allocated"):
        return int(backend.max_memory_allocated(device)), f"{device.type} max_memory_allocated"
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024), "peak RSS"  # Linux reports KiB, macOS bytes
