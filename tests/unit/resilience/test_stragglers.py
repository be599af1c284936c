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


def test_the_monitor_reports_the_mean_of_the_steps_since_its_last_check(monkeypatch):
    """One gloo process: a fake clock times the steps, and what the ranks compare is captured."""
    import torch
    import torch.distributed as dist

    from optimus.resilience import stragglers

    clock = iter([0.0, 1.0, 10.0, 13.0, 20.0, 25.0])
    monkeypatch.setattr(stragglers.time, "perf_counter", lambda: next(clock))
    compared = []
    monkeypatch.setattr(stragglers, "find_stragglers", lambda times, hosts, factor: compared.append(times) or [])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monitor = stragglers.StragglerMonitor(every=2, factor=1.5, device=torch.device("cpu"))
        assert monitor.check(2) is None  # no step timed yet: nothing to compare
        for step in (1, 2):
            with monitor.timed_step():
                pass
            assert monitor.check(step) == ([] if step == 2 else None)
        with monitor.timed_step():
            pass
        monitor.check(4)
    finally:
        dist.destroy_process_group()
    assert compared == [[2.0], [5.0]]  # steps of 1 s and 3 s, then the one of 5 s alone
