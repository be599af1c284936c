"""How the zero1/zero2 optimizer (sharded.py) lays parameters out in flat buckets, and what each rank owns.

A bucket is some parameters' local tensors (after TP/EP) laid end to end: `total` elements, padded only to a
multiple of the sharding group's size. Each of the group's `ranks` ranks owns one contiguous `segment` =
ceil(total / ranks) of it, rank r the elements [r * segment, (r + 1) * segment), as in Megatron-Core's
distributed optimizer: of a parameter a rank owns nothing, all, or a flat range (a partial row, whole rows,
a partial last row). No parameter is padded, however few rows it has: 64 experts over 3,072 ranks cost no
more than their elements (cutting each parameter into per-rank row blocks padded them 48x). Gradients are
packed end to end into a [ranks * segment] buffer for the reduce-scatter; the all-gathered [ranks * segment]
is the updated parameters end to end. `cut_buckets` lays the buckets out (the optimizer and the dry run
share it); `checkpoint_view` shows a rank's range of a parameter-shaped state tensor as that tensor, for DCP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from optimus.checkpoint.flat_range import FlatRangeTensor


@dataclass(repr=False, eq=False)
class Slot:
    """One parameter inside a bucket: where its local tensor lies, the range this rank owns and its fp32 master."""

    name: str
    param: nn.Parameter
    offset: int  # where the parameter's local tensor starts in the bucket (the same on every rank)
    numel: int  # elements of the local tensor
    own_start: int  # the first element this rank owns, an index into the flattened local tensor
    own_numel: int  # how many it owns (0: none)
    shard_offset: int  # where they lie in this rank's [segment] of the bucket
    master: torch.Tensor = None  # fp32 [own_numel]
    aliased: bool = False  # master is a view of the parameter's own elements (fp32 parameters)

    def owned(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's range of a tensor shaped like the parameter's local tensor (a 1-D view)."""
        return local.reshape(-1)[self.own_start:self.own_start + self.own_numel]


@dataclass(repr=False, eq=False)
class BucketLayout:
    """A bucket's parameters in order, with `rank`'s ranges, and its size: `total` elements in `segment`s."""

    slots: list[Slot]
    total: int
    segment: int  # elements per rank: ceil(total / ranks)
    held: int  # of this rank's segment, the elements that are parameters' (the rest: the padding tail)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def cut_buckets(named: list[tuple[str, nn.Parameter]], ranks: int, rank: int,
                bucket_numel: int) -> list[BucketLayout]:
    """Lay `named` out in buckets of at least `bucket_numel` elements (a parameter is never split between
    buckets), in order, each cut into `ranks` segments, with `rank`'s ranges. Works on meta (the dry run)."""
    groups, current, size = [], [], 0
    for name, param in named:
        current.append((name, param))
        size += local_tensor(param).numel()
        if size >= bucket_numel:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return [_layout(group, ranks, rank) for group in groups]


def _layout(named: list[tuple[str, nn.Parameter]], ranks: int, rank: int) -> BucketLayout:
    total = sum(local_tensor(param).numel() for _, param in named)
    segment = math.ceil(total / ranks)
    lo, hi = rank * segment, (rank + 1) * segment  # this rank's elements of the bucket
    slots, offset = [], 0
    for name, param in named:
        numel = local_tensor(param).numel()
        start, stop = max(lo, offset), min(hi, offset + numel)
        if stop > start:
            slots.append(Slot(name, param, offset, numel, start - offset, stop - start, start - lo))
        else:  # owns none of it: an empty range where it would be
            slots.append(Slot(name, param, offset, numel, 0, 0, min(max(offset - lo, 0), segment)))
        offset += numel
    return BucketLayout(slots, total, segment, max(0, min(hi, total) - lo))


def checkpoint_view(slot: Slot, data: torch.Tensor) -> FlatRangeTensor:
    """`data` (this rank's range of a tensor shaped like the parameter's local tensor) as a tensor of the
    parameter's global shape: the range's boxes placed at the local (EP/TP) tensor's global offset, as its
    DTensor placements give it (checkpoint/flat_range.py)."""
    param = slot.param
    local_shape = tuple(local_tensor(param).shape)
    origin = (0,) * len(local_shape)
    if isinstance(param, DTensor):
        shape, origin = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(shape) != local_shape:  # (placements whose local part is not one block of the whole)
            raise ValueError(f"{slot.name}: its local tensor is not one block of the parameter ({param.placements})")
    return FlatRangeTensor(data, tuple(param.shape), tuple(origin), local_shape, slot.own_start)
