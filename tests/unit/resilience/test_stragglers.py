"""find_stragglers: which ranks are slower than factor x the median step time."""

from __future__ import annotations

from optimus.resilience.stragglers import find_stragglers


def test_the_slow_rank_of_two_is_named():
    found = find_stragglers([0.10, 0.40], ["a", "b"], factor=1.5)
    assert [(s.rank, s.host, s.step_time_s, s.median_s) for s in found] == [(1, "b", 0.40, 0.10)]


def test_ranks_within_the_factor_are_not_named():
    assert find_stragglers([0.10, 0.12, 0.11, 0.14], ["h"] * 4, factor=1.5) == []


def test_several_slow_ranks_among_many():
    times = [0.1, 0.1, 0.5, 0.1, 0.1, 0.1, 0.3, 0.1]
    assert [s.rank for s in find_stragglers(times, [f"h{i}" for i in range(8)], factor=2.0)] == [2, 6]


def test_a_rank_exactly_at_the_factor_is_not_named():
    """A straggler is strictly slower than factor x the median: a rank at exactly that time is not named."""
    assert find_stragglers([0.25, 0.5], ["a", "b"], factor=2.0) == []
    assert [s.rank for s in find_stragglers([0.25, 0.5000001], ["a", "b"], factor=2.0)] == [1]
