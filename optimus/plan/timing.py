"""Timing helpers of the planner's calibration: the fastest of a few calls, timed to the end of a device's work,
and a count of the operators dispatched."""

from __future__ import annotations

import time
from typing import Callable

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
