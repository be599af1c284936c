"""Checkpointing as a callback: a save every `train.ckpt_every` steps and at the last one, asynchronous
saves committed before the next save and at the end, and each committed checkpoint announced to the
other callbacks with how long it took."""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING

from optimus.train.callbacks.base import Callback

if TYPE_CHECKING:
    from optimus.train.trainer import Trainer


class Checkpointing(Callback):
    """Every rank: saves are collective (DCP), and so is committing an asynchronous one.

    The record announced with a committed checkpoint holds `checkpoint_save_s` (from the save's start
    to its commit: the whole write, in the background for an asynchronous save) and
    `checkpoint_blocking_s` (how long training waited for it).
    """

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self._timings: dict[int, tuple[float, float]] = {}  # step -> (save started, seconds training waited)

    def after_step(self, step: int) -> None:
        train = self.trainer.config.train
        at_end = step == train.max_steps
        if at_end or (train.ckpt_every and step % train.ckpt_every == 0):
            self.save(step)
            if at_end:
                self.commit_pending()  # an asynchronous save must be on disk before the run ends

    def save(self, step: int) -> None:
        """Checkpoint the trainer's state at `step` (collective); announced once committed."""
        self.commit_pending()
        trainer = self.trainer
        meta = {"model": trainer.config.model.model_dump(), "contents": sorted(trainer.state)}
        asynchronous = trainer.config.train.async_checkpoint
        started = time.perf_counter()
        trainer.checkpoints.save(step, trainer.state, meta, asynchronous=asynchronous)
        self._timings[step] = (started, time.perf_counter() - started)
        if not asynchronous:
            self._announce(step)

    def commit_pending(self) -> None:
        """Wait for an asynchronous save, if one is being written, and commit it (collective)."""
        step = self.trainer.checkpoints.finish_pending()
        if step is not None:
            self._announce(step)

    def on_error(self, error: BaseException) -> None:
        # training already failed: keep a checkpoint that finished writing, but report the first error
        try:
            step = self.trainer.checkpoints.finish_pending_on_exit()
            if step is not None:
                self._announce(step)
        except Exception as err:
            warnings.warn(f"after training failed, keeping the checkpoint it was writing failed too: {err}",
                          stacklevel=2)

    def _announce(self, step: int) -> None:
        """Callbacks hear of a checkpoint once it is committed, i.e. once a rerun would resume from it."""
        started, blocking = self._timings.pop(step, (time.perf_counter(), 0.0))
        record = {"step": step, "checkpoint_save_s": time.perf_counter() - started, "checkpoint_blocking_s": blocking}
        self.trainer.dispatch("on_checkpoint_timing", step, record)
        self.trainer.dispatch("on_checkpoint", step)
