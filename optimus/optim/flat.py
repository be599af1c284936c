"""How the zero1/zero2 optimizer (sharded.py) cuts each parameter into per-rank row blocks.

A parameter's local tensor (after TP/EP) is cut along one dim into ceil-sized blocks, one per rank of
its sharding group, as torch.chunk and FSDP2's Shard(0) cut it (the last blocks short or empty).
Gradients travel in flat buckets: `pack_for_ranks` writes a tensor into a bucket buffer as every rank's
block side by side (zero-padded to the common block size) for a reduce-scatter, `unpack_from_ranks`
copies the all-gathered blocks back into the whole parameter. `cut_buckets` lays parameters out in
buckets (the optimizer and the dry run share it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(repr=False, eq=False)
class Slot:
    """One parameter inside a bucket: its place in the per-rank segment, its owned rows and its fp32 master."""

    name: str
    param: nn.Parameter
    rows: int  # size of the sharded dim of the local (post TP/EP) tensor
    chunk: int  # of those per rank, ceil(rows / group size)
    row_numel: int  # elements per unit of the sharded dim
    offset: int  # start of this parameter's chunk inside a rank's segment of the bucket
    own_start: int
    own_rows: int
    master: torch.Tensor = None  # fp32 [own_rows, ...]
    aliased: bool = False  # master is a view of the parameter's own rows (fp32 parameters)
    dim: int = 0  # the sharded dim: 0, or 1 for expert weights whose experts do not divide (as FSDP2)

    @property
    def padded(self) -> int:
        return self.chunk * self.row_numel

    @property
    def owned(self) -> int:
        return self.own_rows * self.row_numel



def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def shard_dim(local: torch.Tensor, ranks: int, expert: bool) -> int:
    """Dim 0, except expert weights whose local experts do not divide over the ranks but whose dim 1 does:
    FSDP2's choice (data_parallel._expert_shard_dim), so that 8 experts over 32 ranks are not 4x padded."""
    if expert and local.ndim > 1 and local.shape[0] % ranks and local.shape[1] % ranks == 0:
        return 1
    return 0


def owned_block(slot: "Slot", local: torch.Tensor) -> torch.Tensor:
    """This rank's block of a parameter-shaped tensor (a view; contiguous for dim 0)."""
    if local.ndim == 0:
        return local.view(1)
    return local.narrow(slot.dim, slot.own_start, slot.own_rows)


def pack_for_ranks(slot: "Slot", tensor: torch.Tensor, region: torch.Tensor) -> None:
    """Write `tensor` into `region` ([ranks, slot.padded], a view of a bucket buffer): row r is rank r's block,
    flattened; the padding tail after the last element is zeroed (the buffer is reused: it holds old data).

    One copy per element (the cast to the buffer's dtype fused into it), no padded intermediate."""
    if slot.dim != 0:  # dim 1 divides evenly (shard_dim): [d0, ranks, chunk, ...] -> [ranks, d0, chunk, ...]
        d0 = tensor.shape[0]
        region.view(region.shape[0], d0, -1).copy_(tensor.reshape(d0, region.shape[0], -1).transpose(0, 1))
        return
    if slot.padded == 0:
        return
    flat = tensor.reshape(-1)
    full, rest = divmod(flat.numel(), slot.padded)  # whole rank blocks, then the elements of a short one
    region[:full].copy_(flat[:full * slot.padded].view(full, slot.padded))
    if rest:
        region[full, :rest].copy_(flat[full * slot.padded:])
        region[full, rest:].zero_()
        full += 1
    region[full:].zero_()


def unpack_from_ranks(slot: "Slot", region: torch.Tensor, local: torch.Tensor) -> None:
    """Inverse of pack_for_ranks: copy every rank's block ([ranks, slot.padded]) into the whole `local` tensor
    (one copy per element; the padding is not read)."""
    ranks = region.shape[0]
    if slot.dim != 0:
        local.view(local.shape[0], ranks, -1).copy_(region.view(ranks, local.shape[0], -1).transpose(0, 1))
        return
    if slot.padded == 0:
        return
    flat = local.view(-1)  # parameters are contiguous (a non-viewable one raises here rather than being missed)
    full, rest = divmod(flat.numel(), slot.padded)
    flat[:full * slot.padded].view(full, slot.padded).copy_(region[:full])
    if rest:
        flat[full * slot.padded:].copy_(region[full, :rest])


def owned_numel(params: list[nn.Parameter], experts: set[nn.Parameter], dp: int, expert_dp: int,
                ep_aware: bool) -> int:
    """Elements of optimizer state (per state tensor) the largest-holding rank owns for `params` (works on meta).

    Non-expert rows are cut over dp (EP-aware) or expert_dp; expert rows over expert_dp; ceil-sized
    blocks as ShardedOptimizer cuts them. For the dry run's memory table.
    """
    total = 0
    for param in params:
        local = local_tensor(param)
        ranks = expert_dp if (param in experts or not ep_aware) else dp
        rows = local.shape[shard_dim(local, ranks, param in experts)] if local.ndim else 1
        total += math.ceil(rows / ranks) * (local.numel() // max(rows, 1))
    return total


def cut_buckets(named: list[tuple[str, nn.Parameter]], ranks: int, rank: int, expert: bool,
                bucket_numel: int) -> list[tuple[list[Slot], int]]:
    """Lay `named` out in buckets of about `bucket_numel` elements (over all `ranks`), in order: each bucket as
    (its slots, with `rank`'s owned rows, and its segment: elements per rank). Works on meta (the dry run)."""
    buckets, slots, segment = [], [], 0
    for name, param in named:
        local = local_tensor(param)
        dim = shard_dim(local, ranks, expert)
        rows = local.shape[dim] if local.ndim else 1
        row_numel = local.numel() // rows if rows else 0
        chunk = math.ceil(rows / ranks)
        start = min(rank * chunk, rows)
        slots.append(Slot(name, param, rows, chunk, row_numel, segment, start, min(rows, start + chunk) - start,
                          dim=dim))
        segment += slots[-1].padded
        if segment * ranks >= bucket_numel:
            buckets.append((slots, segment))
            slots, segment = [], 0
    if slots:
        buckets.append((slots, segment))
    return buckets
