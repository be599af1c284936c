"""A tensor of which this rank holds one flat range, checkpointed under its own key and global shape.

The zero1/zero2 optimizer (optim/sharded.py) gives each rank a contiguous range [start, stop) of a bucket of
parameters laid end to end, so of one parameter a rank may own a partial row, some whole rows, a partial
last row. Its state is saved as what it is a part of: the parameter-shaped tensor ("state.<name>.exp_avg",
the parameter's global shape), so DCP reshards it to any other layout or shard mode. A flat range of a
row-major tensor is a union of a few rectangular boxes (`range_boxes`), and DCP saves and loads a tensor
with several boxes per rank through three methods it looks for on the object (the protocol DTensor itself
implements): `__create_write_items__` (one write item per box), `__create_chunk_list__` (the boxes to
fill on load) and `__get_tensor_shard__` (the box at an offset, as a view of the rank's flat data, so
loading writes straight into the live optimizer state).

DCP's asynchronous save first copies the state to CPU as plain tensors of each tensor's own size, which
would lose the boxes: `staged()` makes the copy instead (checkpoint/writer.py calls it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The elements [start, stop) of a row-major tensor of `shape` as rectangular boxes, in order: a partial
    first row, the whole rows, a partial last row, each partial row cut the same way one dim down. Each box
    is a contiguous run of the range (at most 2 x ndim - 1 boxes)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner  # the rows touched
    rest = tuple(shape[1:])

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in range_boxes(rest, lo, hi)]

    if first == last:
        return in_row(first, start - first * inner, stop - first * inner)
    boxes = []
    if start % inner:  # a partial first row
        boxes += in_row(first, start % inner, inner)
        first += 1
    whole_end = stop // inner
    if whole_end > first:
        boxes.append(((first, *[0] * len(rest)), (whole_end - first, *rest)))
    if stop % inner:  # a partial last row
        boxes += in_row(whole_end, 0, stop % inner)
    return boxes


class FlatRangeTensor(torch.Tensor):
    """A tensor of global shape `shape` of which this rank holds the flat range [start, start + data.numel())
    of its local block (`local_shape`, at `origin` in the global tensor: a tensor/expert-parallel piece, or the
    whole tensor). `data` is 1-D and used as is (no copy): loading writes into it.

    Only DCP's checkpoint protocol and `local()` / `full_tensor()` are supported; tensor operations raise.
    """

    _data: torch.Tensor
    _chunks: list[ChunkStorageMetadata]
    _starts: list[int]  # where each chunk's elements begin in _data

    @staticmethod
    def __new__(cls, data: torch.Tensor, shape: tuple[int, ...], origin: tuple[int, ...],
                local_shape: tuple[int, ...], start: int) -> "FlatRangeTensor":
        if data.ndim != 1:
            raise ValueError(f"FlatRangeTensor holds a 1-D range, got a tensor of shape {tuple(data.shape)}")
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=data.dtype, device=data.device)
        out._data = data
        out._chunks, out._starts, begin = [], [], 0
        for offsets, sizes in range_boxes(tuple(local_shape), start, start + data.numel()):
            out._chunks.append(ChunkStorageMetadata(offsets=torch.Size(o + d for o, d in zip(offsets, origin)),
                                                    sizes=torch.Size(sizes)))
            out._starts.append(begin)
            begin += math.prod(sizes)
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ARG003
        raise TypeError(f"{func} on a FlatRangeTensor (a checkpoint view of a rank's flat range): use .local()")

    def __repr__(self) -> str:  # (Tensor's own repr would run tensor operations)
        return f"FlatRangeTensor(shape={tuple(self.shape)}, dtype={self.dtype}, boxes={len(self._chunks)})"

    def local(self) -> torch.Tensor:
        """This rank's elements, 1-D, in the tensor's row-major order (the live data, not a copy)."""
        return self._data

    def staged(self) -> "FlatRangeTensor":
        """The same range over a CPU copy of the data (what DCP's asynchronous save writes from)."""
        copy = self._data.detach().to("cpu", copy=True)
        out = torch.Tensor._make_wrapper_subclass(type(self), self.shape, dtype=self.dtype, device=copy.device)
        out._data, out._chunks, out._starts = copy, self._chunks, self._starts
        return out

    def _box(self, index: int) -> torch.Tensor:
        sizes = self._chunks[index].sizes
        begin = self._starts[index]
        return self._data[begin:begin + math.prod(sizes)].view(sizes)

    # --- DCP's checkpoint protocol ------------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:  # noqa: ARG002
        properties = TensorProperties.create_from_tensor(self._data)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape))
                for chunk in self._chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return list(self._chunks)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        hint = index.index
        if hint is not None and hint < len(self._chunks) and self._chunks[hint].offsets == index.offset:
            return self._box(hint)
        for position, chunk in enumerate(self._chunks):
            if chunk.offsets == index.offset:
                return self._box(position)
        raise ValueError(f"no box of '{index.fqn}' starts at {index.offset} on this rank")

    def full_tensor(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The whole tensor, assembled from every rank's boxes (collective over `group`, default every rank:
        each must call it for the same key). For tests and tools: it moves every box through pickling."""
        mine = [(tuple(c.offsets), self._box(i).detach().cpu().clone()) for i, c in enumerate(self._chunks)]
        pieces = [mine]
        if dist.is_initialized():
            pieces = [None] * dist.get_world_size(group)
            dist.all_gather_object(pieces, mine, group=group)
        out = torch.zeros(self.shape, dtype=self.dtype)
        for rank_pieces in pieces:
            for offsets, box in rank_pieces:
                out[tuple(slice(o, o + s) for o, s in zip(offsets, box.shape))].copy_(box)
        return out.to(self._data.device)
