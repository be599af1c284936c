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
