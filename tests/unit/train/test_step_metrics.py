"""train/callbacks/step_metrics.py: what the throughput window covers, and which record names the planned memory."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from optimus.train import metrics
from optimus.train.callbacks.step_metrics import MemoryMetrics, ThroughputMetrics


def test_the_first_window_starts_at_the_first_step_not_at_construction():
    """The trainer builds its callbacks, then data, checkpoints and evaluation set-up run before step 1: none of
    that is training time. A clock the test moves: built at 0 s, step 1 starts at 50 s, 1,000 tokens by 52 s (500
    tokens/s); step 2 adds 1,000 more by 54 s, logged from 52 s (500 tokens/s, not since step 1's start)."""
    clock = [0.0]
    trainer = SimpleNamespace(flops_per_token=10.0, peak_flops=1e5, dims=SimpleNamespace(dp=1, world_size=1),
                              is_rank0=True, peak_source="test", precision=SimpleNamespace(
                                  dtype="fp32", requested="fp32", reason="as configured"))
    records = []
    with mock.patch.object(metrics, "time", SimpleNamespace(perf_counter=lambda: clock[0])):
        callback = ThroughputMetrics(trainer)
        for step, (start, end) in enumerate([(50.0, 52.0), (52.0, 54.0)], start=1):
            clock[0] = start
            callback.on_step_start(step)
            clock[0] = end
            callback.on_step_result(step, SimpleNamespace(tokens=1000))
            records.append({})
            callback.on_log(step, None, records[-1])
    assert [r["tokens_per_s"] for r in records] == [pytest.approx(500.0)] * 2
    assert records[0]["mfu"] == pytest.approx(500.0 * 10.0 / 1e5)
    assert records[0]["dtype"] == "fp32" and "dtype" not in records[1]  # how it was measured: the first row only


def test_the_planned_peak_is_named_once_beside_every_rows_measured_peak():
    callback = MemoryMetrics(torch.device("cpu"), planned_peak_bytes=3 * 2**30)
    first, second = {}, {}
    callback.on_log(1, None, first)
    callback.on_log(2, None, second)
    assert first["memory_planned_gib"] == 3.0 and first["memory_source"] == "peak RSS"
    assert "memory_planned_gib" not in second and "memory_source" not in second
    assert len(first["memory_peak_gib"]) == len(second["memory_peak_gib"]) == 1 and second["memory_peak_gib"][0] > 0


def test_memory_is_logged_in_gib_to_four_decimals(monkeypatch):
    from optimus.train.callbacks import step_metrics

    monkeypatch.setattr(step_metrics, "peak_memory_bytes", lambda device: (1.23456789 * 2**30, "resident set"))
    record = {}
    MemoryMetrics(torch.device("cpu"), planned_peak_bytes=0.98765432 * 2**30).on_log(1, None, record)
    assert record == {"memory_peak_gib": [1.2346], "memory_source": "resident set", "memory_planned_gib": 0.9877}


def test_pacing_a_step_already_slower_than_the_pace_does_not_wait():
    from optimus.train.callbacks.fault_injection import PaceSteps

    pace = PaceSteps(0.0)
    pace.on_step_start(1)
    pace.on_step_end(1, {})  # 0 s minus the time the step took: no negative sleep
