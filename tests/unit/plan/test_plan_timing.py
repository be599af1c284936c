"""The calibration's timing helpers: the fastest of the timed calls after an untimed one, each waited for on a
device; operators counted as dispatched."""

from __future__ import annotations

import itertools
import types

import torch

from optimus.plan import timing


def test_best_time_is_the_fastest_timed_call_after_one_untimed(monkeypatch):
    """The untimed first call (allocation, first dispatch) is the slowest and never counts."""
    durations = iter([5.0, 3.0, 1.0, 2.0])  # seconds each call of fn takes on a fake clock
    clock = itertools.count()
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def fn() -> None:
        next(clock)
        now[0] += next(durations)

    assert timing.best_time(fn, repeats=3) == 1.0 and next(clock) == 4  # 1 untimed + 3 timed


def test_each_timed_call_waits_for_the_devices_work(monkeypatch):
    """On an accelerator the call returns before its kernels end: the clock stops after the device's synchronize."""
    events = []
    fake = types.SimpleNamespace(synchronize=lambda: events.append("sync"))
    monkeypatch.setattr(torch, "cuda", fake)
    timing.best_time(lambda: events.append("call"), repeats=2, device=torch.device("cuda"))
    assert events == ["call", "sync"] * 3
    assert timing.synchronizer(torch.device("cpu"))() is None and timing.synchronizer(None)() is None


def test_operators_are_counted_as_dispatched():
    a = torch.ones(4)
    with timing.CountOps() as counter:
        (a + 1).mul(2).sum()
    assert counter.count == 3
