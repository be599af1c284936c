"""cut_buckets (optim/flat.py): parameters laid end to end in buckets, each cut into equal per-rank segments
padded only to a multiple of the ranks, whatever the parameters' rows."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from optimus.optim.flat import cut_buckets

SHAPES = [(3, 5), (64,), (2, 4, 3), (1, 7), (5,)]


def _named(shapes) -> list[tuple[str, nn.Parameter]]:
    return [(f"p{i}", nn.Parameter(torch.zeros(shape))) for i, shape in enumerate(shapes)]


@pytest.mark.parametrize("ranks", [1, 3, 4, 8, 200])
@pytest.mark.parametrize("bucket_numel", [1, 40, 10_000])
def test_every_element_is_owned_by_exactly_one_rank_with_only_a_tail_of_padding(ranks, bucket_numel):
    named = _named(SHAPES)
    per_rank = [cut_buckets(named, ranks, rank, bucket_numel) for rank in range(ranks)]
    owners = {name: torch.zeros(p.numel(), dtype=torch.int64) for name, p in named}
    for rank, buckets in enumerate(per_rank):
        assert [[s.name for s in b.slots] for b in buckets] == [[s.name for s in b.slots] for b in per_rank[0]]
        offset_in_order = 0
        for bucket in buckets:
            assert bucket.total == sum(slot.numel for slot in bucket.slots)
            assert bucket.segment == math.ceil(bucket.total / ranks)  # no padding but the last segment's tail
            assert bucket.held == max(0, min(bucket.segment, bucket.total - rank * bucket.segment))
            assert sum(slot.own_numel for slot in bucket.slots) == bucket.held
            end = 0
            for slot in bucket.slots:
                assert slot.numel == math.prod(slot.param.shape)
                owners[slot.name][slot.own_start:slot.own_start + slot.own_numel] += 1
                # the owned elements are this rank's elements of the bucket, at their place in its segment
                if slot.own_numel:
                    assert slot.shard_offset == slot.offset + slot.own_start - rank * bucket.segment == end
                    end += slot.own_numel
            offset_in_order += bucket.total
        assert offset_in_order == sum(p.numel() for _, p in named)
    for name, count in owners.items():
        assert torch.equal(count, torch.ones_like(count)), name  # every element once, over all ranks


def test_buckets_close_once_they_hold_bucket_numel_elements():
    named = _named([(10,), (10,), (30,), (5,), (1,)])
    assert [b.total for b in cut_buckets(named, 2, 0, 20)] == [20, 30, 6]


def test_few_rows_over_many_ranks_cost_only_their_elements():
    """64 experts' [64, 8, 8] weight over 3,072 ranks: segments of ceil(4,096 / 3,072) = 2 elements, the
    buffer 6,144 elements for 4,096 (row blocks: a padded 64-element row per rank, 196,608: 48x)."""
    experts = [("w", nn.Parameter(torch.empty(64, 8, 8, device="meta")))]
    (bucket,) = cut_buckets(experts, 3072, 0, 40_000_000)
    assert (bucket.total, bucket.segment) == (4096, 2)
    assert [cut_buckets(experts, 3072, rank, 40_000_000)[0].held for rank in (2047, 2048, 3071)] == [2, 0, 0]
