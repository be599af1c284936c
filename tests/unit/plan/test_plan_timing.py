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


def _event(name: str, kind, micros: float, annotation: bool = False):
    span = types.SimpleNamespace(elapsed_us=lambda: micros)
    return types.SimpleNamespace(name=name, device_type=kind, time_range=span, is_user_annotation=annotation)


def test_device_kernels_leave_out_the_timelines_annotations():
    """Annotations span kernels on the device timeline (a step, the optimizer's step, a user range): counting them
    would count their kernels twice; host events are not the device's."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [_event("ampere_bf16_gemm", cuda, 10), _event("Memcpy DtoD", cuda, 2), _event("aten::mm", cpu, 50),
              _event("ProfilerStep#3", cuda, 40), _event("Optimizer.step#AdamW.step", cuda, 30),
              _event("optimus.forward", cuda, 20), _event("my range", cuda, 9, annotation=True)]
    assert [e.name for e in timing.device_kernels(events, cuda)] == ["ampere_bf16_gemm", "Memcpy DtoD"]


def test_kernel_time_is_the_fastest_calls_summed_kernels(monkeypatch):
    """Each timed call's kernels are summed (the host's dispatch and the synchronize's round trip are not the
    device's work); the fastest call counts, after an untimed one."""
    cuda = torch.autograd.DeviceType.CUDA
    calls = iter([[30.0, 40.0], [10.0, 5.0], [12.0, 4.0]])  # each profiled call's kernels, us

    class FakeProfile:
        def __init__(self, activities):
            assert activities == [torch.profiler.ProfilerActivity.CUDA]

        def __enter__(self):
            self.kernels = [_event("gemm", cuda, us) for us in next(calls)] + [_event("aten::mm", "cpu", 500)]
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return self.kernels
    ran = []
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(timing, "synchronizer", lambda device: lambda: None)
    seconds = timing.kernel_time(lambda: ran.append(1), 3, torch.device("cuda"))
    assert abs(seconds - 15e-6) < 1e-12 and len(ran) == 4


def test_device_seconds_falls_back_to_the_clock(monkeypatch):
    """No kernels seen (no CUPTI) or the CPU: the fastest call to the end of the device's work."""
    monkeypatch.setattr(timing, "kernel_time", lambda fn, repeats, device: None)
    monkeypatch.setattr(timing, "best_time", lambda fn, repeats, device=None: 7.0)
    assert timing.device_seconds(lambda: None, 2, torch.device("cuda")) == 7.0
    assert timing.device_seconds(lambda: None, 2, None) == 7.0
    monkeypatch.setattr(timing, "kernel_time", lambda fn, repeats, device: 3.0)
    assert timing.device_seconds(lambda: None, 2, torch.device("cuda")) == 3.0
    assert timing.device_seconds(lambda: None, 2, torch.device("cpu")) == 7.0


def test_kernel_time_sums_nothing_on_the_cpu():
    """A CPU's profiled events nest (an aten op inside another): there are no kernels to sum."""
    a = torch.ones(64, 64)  # real operators, which a CPU profile would list (and a sum would count twice)
    assert timing.kernel_time(lambda: a @ a, 1, torch.device("cpu")) is None


def test_kernel_time_is_none_where_the_profiler_sees_no_device_kernel(monkeypatch):
    """No CUPTI (or a profiler that records only the host): no kernel of the device in a call's events means no
    kernel time, so device_seconds falls back to the clock, not to an infinite or zero time."""
    cuda = torch.autograd.DeviceType.CUDA

    class HostOnlyProfile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [_event("aten::mm", torch.autograd.DeviceType.CPU, 500), _event("ProfilerStep#1", cuda, 40)]
    monkeypatch.setattr(torch.profiler, "profile", HostOnlyProfile)
    monkeypatch.setattr(timing, "synchronizer", lambda device: lambda: None)
    assert timing.kernel_time(lambda: None, 3, torch.device("cuda")) is None


def test_kernel_time_neither_calls_nor_profiles_on_the_cpu():
    """A CPU's profiled ops nest (aten::linear over aten::addmm), so their times cannot be summed as kernels: the
    CPU is refused before `fn` runs at all, even where the profiler would record its operators."""
    calls = []

    def work() -> None:
        calls.append(1)
        torch.ones(8).add(1)

    assert timing.kernel_time(work, 2, torch.device("cpu")) is None and calls == []
