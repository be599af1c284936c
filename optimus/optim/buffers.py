"""The zero optimizer's persistent communication buffers (optim/sharded.py), allocated once and reused.

A fresh buffer per reduction costs a page-faulting allocation on CPU and an allocator round trip on
GPU; DeepSpeed's ZeRO-1/2 likewise reduce through a fixed pair of bucket-sized buffers. Buckets take
turns over BUFFERS of them (bucket i uses buffer i % BUFFERS), so at most that many buckets'
collectives are in flight and the memory held is about two buckets, not the whole model (which
per-bucket buffers would hold: zero2 would lose its 1/dp gradient memory). Each buffer is raw bytes,
sized for the largest of its buckets, and viewed per use in the dtype the collective moves:

    reduce-scatter (reduce dtype): [ranks, segment] packed gradients | [segment] output to accumulate
    all-gather (parameter dtype): [ranks, segment] gathered segments | [segment] this rank's segment

where ranks x segment is the bucket's elements padded to a multiple of ranks (optim/flat.py). The reduced
gradient shard itself (fp32 [segment] per bucket) is not here: it lives through the step.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from optimus.optim.flat import cut_buckets

BUFFERS = 2  # one bucket's collective travels while the next bucket is packed (double buffering)
ALIGN = 8  # bytes: a buffer sized for 2-byte elements must still view whole as fp32 (another bucket's, or one rank's)


def buffer_nbytes(buckets: list[tuple[int, int]], width: int, accumulates: bool, reduce_width: int = 4) -> list[int]:
    """Bytes of each persistent buffer for buckets given as (ranks, segment) in order, for parameters of
    `width` bytes per element (the all-gather's dtype) and gradients reduced in `reduce_width` (fp32: 4, bf16:
    2; a one-rank bucket packs in fp32). `accumulates`: a step reduces a bucket more than once (zero2 with
    several micro-batches), the later reductions summed in."""
    nbytes = [0] * min(BUFFERS, len(buckets))
    index = 0
    for (ranks, segment), run in itertools.groupby(buckets):
        count = sum(1 for _ in run)  # equal buckets in a row (the planner's full-size ones) fill the same buffers
        # a bucket over one rank has no collective: it packs straight into its shard, and uses a buffer only
        # to pack the later micro-batches' gradients that are summed in
        if ranks > 1 or accumulates:
            need = max(reduce_width if ranks > 1 else 4, width) * (ranks + 1) * segment
            need = -(-need // ALIGN) * ALIGN  # every bucket sharing the buffer views it whole in its own dtype
            for used in range(index, index + min(count, BUFFERS)):
                nbytes[used % BUFFERS] = max(nbytes[used % BUFFERS], need)
        index += count
    return nbytes


class BucketBuffers:
    """BUFFERS byte buffers, each allocated on its first use (on the parameters' device) and then reused."""

    def __init__(self, nbytes: list[int], device: torch.device):
        self.nbytes, self.device = nbytes, device
        self._storage: list[torch.Tensor | None] = [None] * len(nbytes)

    def index(self, bucket_index: int) -> int:
        """The buffer bucket number `bucket_index` uses."""
        return bucket_index % BUFFERS

    def views(self, index: int, ranks: int, segment: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer `index` as ([ranks, segment], [segment]) of `dtype`, side by side (contents left from last use)."""
        if self._storage[index] is None:
            self._storage[index] = torch.empty(self.nbytes[index], dtype=torch.uint8, device=self.device)
        flat = self._storage[index].view(dtype)
        return flat[:ranks * segment].view(ranks, segment), flat[ranks * segment:(ranks + 1) * segment]

    def data_ptr(self, index: int) -> int:
        """Where buffer `index` lives (0 before its first use): tests check it is reused."""
        storage = self._storage[index]
        return 0 if storage is None else storage.data_ptr()

    def allocated_bytes(self) -> int:
        """Bytes of the buffers allocated so far."""
        return sum(s.numel() for s in self._storage if s is not None)


def bucket_order(model: nn.Module, experts: set[nn.Parameter]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The trained parameters by sharding group ("non_expert", "expert"), named as in one process, in the order
    they fill buckets: reverse registration order ~ the order backward produces gradients (zero2 reduces early
    buckets first)."""
    from optimus.parallel.parallelize import single_process_name

    named = [(single_process_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    by_group: dict[str, list] = {"non_expert": [], "expert": []}
    for name, param in reversed(named):
        by_group["expert" if param in experts else "non_expert"].append((name, param))
    return by_group


def zero_layout(model: nn.Module, dense_ranks: int, expert_ranks: int, bucket_numel: int) -> list[tuple[int, int]]:
    """ShardedOptimizer's buckets for `model` as (ranks, segment), in order (works on meta: the dry run),
    non-expert state sharded over `dense_ranks`, expert state over `expert_ranks`. Rank 0 owns a whole
    segment of every bucket: the most state any rank holds is the sum of the segments."""
    from optimus.optim.sharded import expert_parameters

    by_group = bucket_order(model, expert_parameters(model))
    layout = []
    for kind, ranks in (("non_expert", dense_ranks), ("expert", expert_ranks)):
        layout += [(ranks, bucket.segment) for bucket in cut_buckets(by_group[kind], ranks, 0, bucket_numel)]
    return layout


def buffer_bytes_for(model: nn.Module, dense_ranks: int, expert_ranks: int, width: int, mode: str,
                     bucket_numel: int, reduce_width: int = 4) -> int:
    """Bytes of the persistent communication buffers ShardedOptimizer allocates for `model` (works on meta: the
    dry run), non-expert state sharded over `dense_ranks`, expert state over `expert_ranks`."""
    layout = zero_layout(model, dense_ranks, expert_ranks, bucket_numel)
    return sum(buffer_nbytes(layout, width, mode == "zero2", reduce_width))
