"""Seeded initial weights that can be computed for any slice of any parameter, anywhere.

A parameter's initial values are drawn block by block along dim 0, each block from a generator
of its own, seeded by (run seed, parameter name, block index). The values of rows [lo, hi) are
therefore the same whoever draws them and whatever else they draw: one process fills whole
tensors, and each rank of a sharded model fills only its own shard, so the full model never
has to exist in one place (Mula-220B is ~880 GB in fp32) and nothing is broadcast.
"""

from __future__ import annotations

import hashlib
import math

import torch

# Elements per generator block: large enough that seeding costs nothing next to drawing,
# small enough that a rank needing a few rows draws little it throws away.
BLOCK_ELEMENTS = 1 << 20


def rows_per_block(shape: tuple[int, ...]) -> int:
    """Dim-0 rows drawn from one generator (one expert of a stacked [E, ...] weight, say)."""
    row = math.prod(shape[1:])
    return max(1, BLOCK_ELEMENTS // max(1, row))


def block_seed(seed: int, name: str, block: int) -> int:
    """A generator seed for one block, stable across processes, runs and Python versions."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_rows(seed: int, name: str, shape: tuple[int, ...], std: float | None, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) along dim 0 of parameter `name` of full `shape`, fp32 on the CPU.

    std None means ones (norm weights); otherwise normal(0, std).
    """
    shape = tuple(shape)
    out = torch.empty((hi - lo, *shape[1:]))
    if std is None:
        return out.fill_(1.0)
    per = rows_per_block(shape)
    for block in range(lo // per, -(-hi // per) if hi > lo else lo // per):
        start, stop = block * per, min((block + 1) * per, shape[0])
        generator = torch.Generator().manual_seed(block_seed(seed, name, block))
        values = torch.empty((stop - start, *shape[1:])).normal_(0.0, std, generator=generator)
        first, last = max(lo, start), min(hi, stop)
        out[first - lo : last - lo] = values[first - start : last - start]
    return out


def initial_slice(
    seed: int, name: str, shape: tuple[int, ...], std: float | None, offset: tuple[int, ...], size: tuple[int, ...]
) -> torch.Tensor:
    """The block of parameter `name` starting at `offset` with `size` (any number of dims)."""
    if not shape:  # a scalar parameter
        return initial_rows(seed, name, (1,), std, 0, 1).reshape(())
    rows = initial_rows(seed, name, shape, std, offset[0], offset[0] + size[0])
    for dim in range(1, len(shape)):
        rows = rows.narrow(dim, offset[dim], size[dim])
    return rows
