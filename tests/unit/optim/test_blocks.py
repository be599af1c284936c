"""pack_for_ranks / unpack_from_ranks (optim/blocks.py): every rank's block side by side in a reused bucket
buffer, the padding tail zeroed whatever the buffer held, and the way back into the whole tensor."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from optimus.optim.blocks import Slot, pack_for_ranks, unpack_from_ranks


def _slot(shape: tuple, ranks: int, dim: int, offset: int) -> Slot:
    rows = shape[dim] if shape else 1
    numel = math.prod(shape)
    chunk = math.ceil(rows / ranks)
    return Slot("w", None, rows, chunk, numel // rows, offset, 0, min(rows, chunk), dim=dim)


def _reference(slot: Slot, tensor: torch.Tensor, ranks: int) -> torch.Tensor:
    """The layout the blocks must have: row r = rank r's block, flattened, zero-padded (torch.chunk's cut)."""
    if slot.dim == 0:
        return F.pad(tensor.reshape(-1).float(), (0, ranks * slot.padded - tensor.numel())).view(ranks, slot.padded)
    return torch.stack([block.reshape(-1).float() for block in torch.chunk(tensor, ranks, dim=slot.dim)])


@pytest.mark.parametrize("shape,ranks,dim", [
    ((6, 5), 4, 0),  # blocks of 2, 2, 2 and an empty one
    ((7, 3), 2, 0),  # a short last block: a partly filled rank row
    ((8, 4), 4, 0),  # no padding
    ((), 2, 0),  # a scalar: one element, the other rank's block all padding
    ((3, 8, 2), 2, 1),  # experts that do not divide: cut along dim 1
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_overwrites_stale_buffer_contents_and_unpack_restores_the_tensor(shape, ranks, dim, dtype):
    offset = 3  # the slot sits inside a wider bucket buffer: its neighbours' columns must stay untouched
    slot = _slot(shape, ranks, dim, offset)
    tensor = torch.randn(shape).to(dtype)
    buffer = torch.full((ranks, offset + slot.padded + 2), float("nan"))  # what an earlier use left there
    region = buffer[:, offset:offset + slot.padded]
    pack_for_ranks(slot, tensor, region)
    assert torch.equal(region, _reference(slot, tensor, ranks))  # bitwise: the fp32 cast is exact
    assert buffer[:, :offset].isnan().all() and buffer[:, offset + slot.padded:].isnan().all()
    pack_for_ranks(slot, torch.zeros_like(tensor), region)  # the next step: the tail is still zero
    assert not region.any()

    gathered = torch.full((ranks, offset + slot.padded), float("nan"), dtype=dtype)
    gathered[:, offset:].copy_(_reference(slot, tensor, ranks))
    out = torch.full_like(tensor, float("nan"))
    unpack_from_ranks(slot, gathered[:, offset:], out)
    assert torch.equal(out, tensor)
