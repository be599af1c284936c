"""Throughput: the job's tokens/s and each device's; MFU per device, never above 100%."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from optimus.train import metrics
from optimus.train.metrics import Throughput


def _report(throughput: Throughput, tokens: int, seconds: float):
    """The report of a window exactly `seconds` long: the module's clock reads `seconds` past the window's start
    (a real clock also counted the test's own time: 1.002 s under CI's load read 997.9 tokens/s)."""
    clock = SimpleNamespace(perf_counter=lambda: throughput._start + seconds)
    with mock.patch.object(metrics, "time", clock):
        throughput.add(tokens)
        return throughput.report()


def test_one_device_counts_its_own_tokens():
    r = _report(Throughput(flops_per_token=100.0, peak_flops=1e6), tokens=1000, seconds=1.0)
    assert r.tokens_per_s == pytest.approx(1000, rel=1e-3)
    assert r.tokens_per_s_per_device == pytest.approx(1000, rel=1e-3)
    assert r.mfu == pytest.approx(0.1, rel=1e-3)


@pytest.mark.parametrize("layout", ["tp=2", "pp=2", "tp=2 x pp=2"])
def test_model_parallel_ranks_share_their_replicas_tokens(layout):
    """Under tp or pp one replica's tokens are computed by several devices: MFU is per device, not tp x pp it."""
    devices = {"tp=2": 2, "pp=2": 2, "tp=2 x pp=2": 4}[layout]
    r = _report(Throughput(100.0, 1e6, replicas=1, world_size=devices), tokens=1000, seconds=1.0)
    assert r.tokens_per_s == pytest.approx(1000, rel=1e-3)
    assert r.tokens_per_s_per_device == pytest.approx(1000 / devices, rel=1e-3)
    assert r.mfu == pytest.approx(0.1 / devices, rel=1e-3)


def test_data_parallel_replicas_add_up_to_the_global_rate():
    r = _report(Throughput(100.0, 1e6, replicas=4, world_size=8), tokens=1000, seconds=1.0)  # dp 4 x tp 2
    assert r.tokens_per_s == pytest.approx(4000, rel=1e-3)
    assert r.tokens_per_s_per_device == pytest.approx(500, rel=1e-3)
    assert r.mfu == pytest.approx(0.05, rel=1e-3)


def test_an_mfu_above_100_percent_is_not_reported():
    r = _report(Throughput(100.0, peak_flops=1e4), tokens=1000, seconds=1.0)
    assert r.mfu is None and r.impossible_mfu == pytest.approx(10.0, rel=1e-3)


def test_expert_load_is_each_layers_counts_over_its_own_even_share():
    """Layer 0 routes 4 tokens to expert 0 alone (its even share 2: 2.0 and 0.0); layer 1 splits 1 + 1 (1.0 each).
    Over all layers' counts at once the even share would be 1.5 (2.67 and 0.0)."""
    from optimus.train.metrics import expert_load_summary

    summary = expert_load_summary(torch.tensor([[4, 0], [1, 1]]))
    assert summary == {"expert_load_max": pytest.approx(2.0), "expert_load_min": pytest.approx(0.0)}
    assert expert_load_summary(torch.tensor([[3, 1], [1, 3]]))["expert_load_min"] == pytest.approx(0.5)


def test_the_cpu_peak_is_the_resident_set_in_bytes():
    """A 256 MiB tensor written through (every page resident) raises the peak to at least that much, in bytes (Linux
    reports KiB, macOS bytes)."""
    from optimus.train.metrics import peak_memory_bytes

    block = torch.ones(64 * 1024 * 1024)  # 256 MiB of fp32, every page touched
    peak, what = peak_memory_bytes(torch.device("cpu"))
    assert what == "peak RSS" and peak >= block.numel() * block.element_size()
    assert peak < 64 * 1024**3  # bytes, not KiB counted as bytes x 1024 again


def test_the_even_share_divides_by_the_experts_not_the_layers():
    """One layer of four experts, all 8 copies on expert 0: an even split gives each expert 2, so 4.0x and 0.0x."""
    from optimus.train.metrics import expert_load_summary

    summary = expert_load_summary(torch.tensor([[8, 0, 0, 0]]))
    assert summary == {"expert_load_max": pytest.approx(4.0), "expert_load_min": pytest.approx(0.0)}
