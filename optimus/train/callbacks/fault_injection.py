"""Fault injection for `optimus chaos`: a non-finite loss at chosen steps, as a bad batch or a flaky
device would produce, so the harness can show that every rank skips that step together; and a
checkpoint write that fails as on a full disk, when the harness says so."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import torch
from torch import nn

from optimus.train.callbacks.base import Callback


class NonFiniteAtSteps(Callback):
    """Makes the forward pass of each listed step produce NaN on this rank (every later op sees it)."""

    def __init__(self, model: nn.Module, steps: set[int]):
        self.steps = steps
        # the first module this rank runs: the embedding on the first pipeline stage, else its first block
        self.target = getattr(model, "embed", None) or next(iter(model.layers.values()))
        self._hook = None

    def on_step_start(self, step: int) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if step in self.steps:
            self._hook = self.target.register_forward_hook(lambda module, args, out: out * torch.nan)

    def on_train_end(self, step: int) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def fail_checkpoint_writes_when(trigger: Path) -> None:
    """From now on in this process, a checkpoint write finding `trigger` removes it and fails with ENOSPC.

    The failure is raised inside DCP's write step, where a real full disk shows up; the first rank to
    find the file takes it, so one save of one rank fails, and the others learn of it as they would.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def write_data_or_fail(self, plan, planner):
        try:
            trigger.unlink()
        except FileNotFoundError:
            return write_data(self, plan, planner)
        raise OSError(errno.ENOSPC, "No space left on device (injected by optimus chaos)")

    FileSystemWriter.write_data = write_data_or_fail


class PaceSteps(Callback):
    """Makes every step last at least `seconds`, so a harness watching a tiny model's steps can strike
    at the step it planned (a real model's steps take seconds; a test model's, milliseconds)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._started = 0.0

    def on_step_start(self, step: int) -> None:
        self._started = time.monotonic()

    def on_step_end(self, step: int, metrics) -> None:
        time.sleep(max(0.0, self.seconds - (time.monotonic() - self._started)))
