"""run_on_local_ranks: the shipped runner the planner's calibration measures with."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optimus.parallel.local_ranks import LocalRanksError, run_on_local_ranks


def _sum_of_ranks(rank: int, world: int, scale: float) -> list[float]:
    value = torch.tensor([float(rank) * scale])
    dist.all_reduce(value)
    return [rank, float(value)]


def _fails_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("planted failure")
    return rank


@pytest.mark.distributed
def test_each_rank_result_comes_back_in_rank_order():
    assert run_on_local_ranks(_sum_of_ranks, 2, 2.0) == [[0, 2.0], [1, 2.0]]


@pytest.mark.distributed
def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(LocalRanksError, match=r"rank 1 of 2 failed:(.|\n)*planted failure"):
        run_on_local_ranks(_fails_on_rank_one, 2, timeout=60.0)
