"""range_boxes and FlatRangeTensor (checkpoint/flat_range.py): a rank's flat range of a tensor as rectangular
boxes, saved and loaded by DCP under the tensor's own key and global shape."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from optimus.checkpoint.flat_range import FlatRangeTensor, range_boxes

SHAPES = [(7,), (3, 5), (2, 3, 4), (1, 4, 1, 3), (4, 1), (0, 3)]


def _ranges(numel: int):
    """Every [start, stop) for small tensors, a sample of them for larger ones."""
    pairs = list(itertools.combinations(range(numel + 1), 2))
    return pairs if len(pairs) <= 400 else pairs[::7]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_boxes_cover_the_range_exactly_once_in_order(shape):
    numel = math.prod(shape)
    flat_index = torch.arange(numel).view(shape)
    for start, stop in _ranges(numel):
        boxes = range_boxes(shape, start, stop)
        covered = torch.zeros(numel, dtype=torch.int64)
        runs = []
        for offsets, sizes in boxes:
            assert len(offsets) == len(sizes) == len(shape) and all(s > 0 for s in sizes)
            assert all(o + s <= d for o, s, d in zip(offsets, sizes, shape)), (shape, offsets, sizes)
            block = flat_index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
            covered[block] += 1
            assert torch.equal(block, torch.arange(block[0], block[0] + block.numel())), "a box is a contiguous run"
            runs.append((int(block[0]), int(block[-1]) + 1))
        mask = torch.zeros(numel, dtype=torch.int64)
        mask[start:stop] = 1
        assert torch.equal(covered, mask), (shape, start, stop, boxes)  # each element of the range once, no other
        assert [a for a, _ in runs] == sorted(a for a, _ in runs)  # in the range's order, end to end
        assert all(b == c for (_, b), (c, _) in zip(runs, runs[1:]))
        assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_an_empty_range_has_no_boxes_and_a_scalar_one():
    assert range_boxes((3, 4), 5, 5) == []
    assert range_boxes((), 0, 1) == [((), ())]


def _load(path, value):
    import torch.distributed.checkpoint as dcp

    from optimus.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner

    dcp.load({"w": value}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)


def test_ranges_load_their_boxes_from_a_whole_tensor_and_save_as_it(tmp_path):
    """A checkpoint of a whole [5, 3, 4] tensor read into ranges of it (what a zero rank loads after fsdp or one
    process saved it); a range that covers the tensor saves as that tensor. (Several ranks saving their ranges of
    one key: tests/distributed/test_zero_flat_buckets.py.)"""
    import torch.distributed.checkpoint as dcp

    whole = torch.randn(5, 3, 4)
    dcp.save({"w": whole}, storage_writer=dcp.FileSystemWriter(tmp_path / "whole"), no_dist=True)
    for start, stop in ((0, 7), (7, 29), (29, 60), (13, 14), (0, 60)):
        ranged = FlatRangeTensor(torch.zeros(stop - start), (5, 3, 4), (0, 0, 0), (5, 3, 4), start)
        _load(tmp_path / "whole", ranged)
        assert torch.equal(ranged.local(), whole.reshape(-1)[start:stop]), (start, stop)
    dcp.save({"w": ranged}, storage_writer=dcp.FileSystemWriter(tmp_path / "ranged"), no_dist=True)
    back = torch.zeros_like(whole)
    _load(tmp_path / "ranged", back)
    assert torch.equal(back, whole)


def test_a_range_of_a_tensor_parallel_piece_is_placed_at_the_piece_origin(tmp_path):
    import torch.distributed.checkpoint as dcp

    whole = torch.randn(6, 4)
    piece = whole[3:, 2:]  # the local block of a tensor split over both dims, at (3, 2)
    dcp.save({"w": whole}, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    ranged = FlatRangeTensor(torch.zeros(4), (6, 4), (3, 2), (3, 2), 1)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in ranged.__create_chunk_list__()] == [
        ((3, 3), (1, 1)), ((4, 2), (1, 2)), ((5, 2), (1, 1))]
    _load(tmp_path, ranged)
    assert torch.equal(ranged.local(), piece.reshape(-1)[1:5])
    full = ranged.full_tensor()  # one process: only its own boxes, zeros elsewhere
    assert torch.equal(full[3:, 2:].reshape(-1)[1:5], piece.reshape(-1)[1:5]) and full.abs().sum() > 0
    assert full[:3].abs().sum() == 0


def test_tensor_operations_are_refused_with_a_pointer_to_local():
    ranged = FlatRangeTensor(torch.arange(4.0), (2, 3), (0, 0), (2, 3), 1)
    with pytest.raises(TypeError, match="use .local()"):
        ranged.clone()
    staged = ranged.staged()
    assert staged.local().data_ptr() != ranged.local().data_ptr() and torch.equal(staged.local(), ranged.local())
    assert staged.__create_chunk_list__() == ranged.__create_chunk_list__()


def test_an_empty_range_of_a_scalar_has_no_boxes():
    """A rank that owns none of a 0-d parameter writes no box (a box of a scalar is one element it lacks)."""
    assert range_boxes((), 0, 0) == []
    assert FlatRangeTensor(torch.zeros(0), (), (), (), 0).__create_chunk_list__() == []


def test_a_shard_index_hint_one_past_the_last_box_falls_back_to_the_offset():
    from torch.distributed.checkpoint.metadata import MetadataIndex

    ranged = FlatRangeTensor(torch.arange(4.0), (2, 3), (0, 0), (2, 3), 1)  # boxes at (0, 1) and (1, 0)
    box = ranged.__get_tensor_shard__(MetadataIndex("w", torch.Size((1, 0)), index=2))
    assert torch.equal(box, torch.tensor([[2.0, 3.0]]))


def test_an_asynchronous_saves_staging_copies_ranges_as_ranges_even_alone_in_their_dict(tmp_path):
    from optimus.checkpoint.writer import CheckpointWriter

    live = torch.arange(4.0)
    staged = CheckpointWriter(tmp_path, "{}").stage(
        {"opt": {"state": {"w": FlatRangeTensor(live, (2, 3), (0, 0), (2, 3), 1)}}, "b": torch.ones(2)})
    copy = staged["opt"]["state"]["w"]
    assert isinstance(copy, FlatRangeTensor) and copy.__create_chunk_list__()[0].offsets == torch.Size((0, 1))
    live.add_(10.0)  # training goes on while the background write runs: the copy keeps the staged values
    assert copy.local().tolist() == [0.0, 1.0, 2.0, 3.0] and torch.equal(staged["b"], torch.ones(2))
