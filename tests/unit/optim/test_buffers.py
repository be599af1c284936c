"""The zero optimizer's persistent buffers: their sizes by the rule optim/buffers.py states."""

from __future__ import annotations

import random

from optimus.optim.buffers import ALIGN, BUFFERS, buffer_nbytes


def _one_bucket_at_a_time(buckets, width, accumulates, reduce_width=4):
    """The rule as the module docstring states it: bucket i in buffer i % BUFFERS, each buffer the largest need."""
    nbytes = [0] * min(BUFFERS, len(buckets))
    for index, (ranks, segment) in enumerate(buckets):
        if ranks > 1 or accumulates:
            need = max(reduce_width if ranks > 1 else 4, width) * (ranks + 1) * segment
            nbytes[index % BUFFERS] = max(nbytes[index % BUFFERS], -(-need // ALIGN) * ALIGN)
    return nbytes


def test_runs_of_equal_buckets_size_the_buffers_as_one_bucket_at_a_time():
    rng = random.Random(0)
    for _ in range(500):
        # the planner's shape: a few large buckets, runs of full ones, a short tail, per group
        buckets = []
        for _group in range(rng.randint(1, 3)):
            ranks = rng.choice([1, 2, 3, 8])
            buckets += [(ranks, rng.randint(1, 999)) for _ in range(rng.randint(0, 2))]
            buckets += [(ranks, rng.randint(1, 999))] * rng.randint(0, 5)
            buckets += [(ranks, rng.randint(1, 999))] * rng.randint(0, 1)
        width, accumulates, reduce_width = rng.choice([2, 4]), rng.random() < 0.5, rng.choice([2, 4])
        assert buffer_nbytes(buckets, width, accumulates, reduce_width) == \
            _one_bucket_at_a_time(buckets, width, accumulates, reduce_width), buckets


def test_a_buckets_gathered_rows_and_its_own_segment_lie_side_by_side_without_overlap():
    """The reduce-scatter reads the [ranks, segment] rows while it writes the [segment] result: on NCCL both are in
    flight at once, so they must not share a byte (gloo copies, and would not show an overlap)."""
    import torch

    from optimus.optim.buffers import BucketBuffers

    for ranks, segment, dtype, width in ((4, 1000, torch.float32, 4), (3, 777, torch.bfloat16, 2)):
        buffers = BucketBuffers(buffer_nbytes([(ranks, segment)], width, accumulates=False), torch.device("cpu"))
        rows, own = buffers.views(0, ranks, segment, dtype)
        assert rows.shape == (ranks, segment) and own.shape == (segment,)
        rows_end = rows.data_ptr() + rows.numel() * rows.element_size()
        assert own.data_ptr() >= rows_end
        assert own.data_ptr() + own.numel() * own.element_size() <= buffers.data_ptr(0) + buffers.nbytes[0]


def test_a_buffer_sized_for_2_byte_elements_still_views_whole_as_fp32():
    """Buckets take turns over a buffer; one packing fp32 (a one-rank bucket) views the whole buffer as fp32, even
    one sized for bf16 gradients: 2 x (ranks + 1) x segment bytes, not a multiple of 4 when (ranks + 1) x segment is
    odd, is rounded up."""
    import torch

    from optimus.optim.buffers import BucketBuffers

    for ranks, segment in ((2, 777), (4, 1), (2, 2)):
        (nbytes,) = buffer_nbytes([(ranks, segment)], 2, accumulates=False, reduce_width=2)
        assert nbytes >= 2 * (ranks + 1) * segment and nbytes % 4 == 0, (ranks, segment, nbytes)
        rows, own = BucketBuffers([nbytes], torch.device("cpu")).views(0, 1, nbytes // 8, torch.float32)
        assert rows.numel() == own.numel() == nbytes // 8
