"""How the zero1/zero2 optimizer (sharded.py) cuts each parameter into per-rank row blocks.

A parameter's local tensor (after TP/EP) is cut along one dim into ceil-sized blocks, one per rank of
its sharding group, as torch.chunk and FSDP2's Shard(0) cut it (the last blocks short or empty).
Gradients travel in flat buckets: `split_for_ranks` lays a tensor out as every rank's block side by
side (zero-padded to the common block size) for a reduce-scatter, `join_from_ranks` undoes it after
the all-gather of the updated blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
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


def split_for_ranks(slot: "Slot", tensor: torch.Tensor, size: int) -> torch.Tensor:
    """[size, slot.padded] fp32: row r is rank r's block of `tensor`, flattened and zero-padded."""
    if slot.dim == 0:
        flat = F.pad(tensor.reshape(-1).float(), (0, size * slot.padded - tensor.numel()))
        return flat.view(size, slot.padded)
    # dim 1 (divides evenly): [d0, size, chunk, ...] -> [size, d0, chunk, ...]
    shape = tensor.shape
    return tensor.reshape(shape[0], size, -1).transpose(0, 1).reshape(size, slot.padded).float()


def join_from_ranks(slot: "Slot", blocks: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Inverse of split_for_ranks: the whole parameter from every rank's block ([size, slot.padded])."""
    if slot.dim == 0:
        return blocks.reshape(-1)[:local.numel()].view_as(local)
    size = blocks.shape[0]
    return blocks.reshape(size, local.shape[0], -1).transpose(0, 1).reshape(local.shape)


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
