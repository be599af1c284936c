"""The index arithmetic behind expert-parallel dispatch (no processes needed)."""

from __future__ import annotations

import torch

from optimus.parallel.expert_parallel import gather_index, segment_starts


def test_segment_starts_is_an_exclusive_prefix_sum():
    counts = torch.tensor([[2, 0], [1, 3]])
    assert segment_starts(counts).tolist() == [[0, 2], [2, 3]]


def test_gather_index_reorders_source_major_rows_to_expert_major():
    # rows arrive grouped (source rank, expert): rank 0 sends 1 row to expert 0 and 2 to expert 1,
    # rank 1 sends 2 and 1: rows 0 | 1 2 | 3 4 | 5
    counts = torch.tensor([[1, 2], [2, 1]])
    order = gather_index(counts.t(), segment_starts(counts).t())
    assert order.tolist() == [0, 3, 4, 1, 2, 5]  # expert 0 (rank 0, rank 1), then expert 1


def test_gather_index_handles_all_empty_segments():
    counts = torch.zeros(3, 2, dtype=torch.long)
    assert gather_index(counts, segment_starts(counts)).numel() == 0


def test_gather_index_with_explicit_starts_skips_padding():
    # two ranks' rows padded to width 4: rank 0 has 3 real rows, rank 1 has 2
    counts = torch.tensor([[3], [2]])
    starts = torch.tensor([[0], [4]])
    assert gather_index(counts, starts).tolist() == [0, 1, 2, 4, 5]
