"""Timing helpers of the planner's calibration: the fastest of a few calls, timed to the end of a device's work or
by the device's own kernel time, and a count of the operators dispatched."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched while active; with `only` (a tensor subclass, e.g. DTensor) just those
    with an argument of that type."""

    def __init__(self, only: type | None = None) -> None:
        super().__init__()
        self.only, self.count = only, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.only is None or self.only in types
        return func(*args, **(kwargs or {}))


def best_time(fn: Callable[[], None], repeats: int = 2, device: torch.device | None = None) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed call (allocation, first dispatch); on an
    accelerator each timed to the end of its work (the device runs it after the call returns)."""
    sync = synchronizer(device)
    fn()  # warm-up: allocation and first-call dispatch
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def synchronizer(device: torch.device | None) -> Callable[[], None]:
    """What waits for `device`'s queued work (cuda and ROCm, xpu); nothing on the CPU."""
    if device is None or device.type == "cpu":
        return lambda: None
    return getattr(torch, device.type).synchronize


def device_kernels(events: Iterable[Any], kind: Any) -> list[Any]:
    """torch.profiler's events that are kernels (and copies) run on a device of `kind` (torch.autograd.DeviceType):
    not the annotations the device timeline also carries (ProfilerStep*, Optimizer.step#AdamW.step, user ranges),
    which span kernels and would count them twice."""
    return [e for e in events if e.device_type == kind and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(("ProfilerStep", "optimus.")) and "#" not in e.name]


def kernel_time(fn: Callable[[], None], repeats: int, device: torch.device) -> float | None:
    """The fastest of `repeats` calls of `fn` by the kernel time `device` spent on it (torch.profiler's kernels,
    summed), after one untimed call; None where the profiler sees no kernel of that device (no CUPTI, say).

    What a GPU preset's efficiencies are read on (benchmarks/step_profile.py): in a training step the host queues
    kernels ahead of the device, and what it leaves the device idle for is op_overhead_us's, priced apart. A call
    timed on the host's clock to a synchronize pays its dispatch, the autograd engine and the synchronize's round
    trip besides: one H200 read Mula-7B-A1B's projections at 1 x 2,048 tokens so at 0.27 of peak, its fused norm and
    SwiGLU block at 0.06 of HBM's bandwidth (2026-11-30), where its training steps ran them at ~0.8 and ~0.7."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activity, kind = (getattr(ProfilerActivity, device.type.upper(), None),
                      getattr(DeviceType, device.type.upper(), None))
    if device.type == "cpu" or activity is None or kind is None:  # a CPU's profiled ops nest: no kernels to sum
        return None
    sync = synchronizer(device)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        with profile(activities=[activity]) as prof:
            fn()
            sync()
        kernels = device_kernels(prof.events() or [], kind)
        if not kernels:
            return None
        best = min(best, sum(k.time_range.elapsed_us() for k in kernels) * 1e-6)
    return best


def device_seconds(fn: Callable[[], None], repeats: int, device: torch.device | None = None) -> float:
    """What `fn`'s work costs the device that runs it: on an accelerator its kernel time (kernel_time; the time to
    the end of its work where the profiler sees no kernels), on the CPU the fastest call (best_time)."""
    if device is not None and device.type != "cpu":
        seconds = kernel_time(fn, repeats, device)
        if seconds:
            return seconds
    return best_time(fn, repeats, device)
