"""The callback interface: every side concern of the training loop hooks into it here.

The Trainer is the loop; what happens around a step is a Callback called at fixed points:

    on_train_start(start, max)        once, before the first step (after a resume's restore)
    per step:
      on_step_start(step)
      -- the optimizer step --
      on_step_result(step, result)    every step; True asks that this step be logged off the cadence
      on a logged step (log_every, the last step, or one a callback asked for):
        on_log(step, result, record)  add fields to the step's record (collectives allowed)
        on_step_end(step, record)     the complete record (metrics.jsonl, console, loggers)
      after_step(step)                the step's side work: guards, preemption, evaluation, checkpoints
      on_progress(step)               the loop moved on (after the step and after each side work)
    on_eval(step, record)             a held-out / downstream evaluation's record
    on_checkpoint_timing(step, record) a checkpoint committed: how long its save took
    on_checkpoint(step)               a checkpoint committed (a rerun would resume from it)
    on_error(error)                   training failed (before on_train_end)
    on_train_end(step)                always, last

The Trainer's own side concerns (checkpointing, evaluation, throughput, memory, expert load,
resilience) are callbacks it creates on every rank: their hooks may run collectives, because every
rank calls them at the same points. Reporting callbacks (files, console, loggers) run on rank 0 only.
"""

from __future__ import annotations

from typing import Any


class Callback:
    """Override what you need; every hook is a no-op by default."""

    def on_train_start(self, start_step: int, max_steps: int) -> None: ...

    def on_step_start(self, step: int) -> None: ...

    def on_step_result(self, step: int, result: Any) -> bool:
        """Every step, right after the optimizer step (`result`: a train.step.StepResult).
        Return True when this step must be logged whatever the cadence (a rare, telling event)."""
        return False

    def on_log(self, step: int, result: Any, record: dict[str, Any]) -> None:
        """A logged step: add this callback's fields to its record. Every rank calls it at the same steps."""

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        """A logged step's complete record."""

    def after_step(self, step: int) -> None:
        """After the step (and its logging): the side work due at this step."""

    def on_progress(self, step: int) -> None:
        """The loop moved on: a step, an evaluation or a checkpoint just finished."""

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None: ...

    def on_checkpoint_timing(self, step: int, record: dict[str, Any]) -> None:
        """A checkpoint of `step` was just committed; `record` holds its step and save timings (seconds)."""

    def on_checkpoint(self, step: int) -> None:
        """A checkpoint of `step` is committed: a rerun would resume from it."""

    def on_error(self, error: BaseException) -> None:
        """Training failed with `error` (it is re-raised after every callback has heard of it)."""

    def on_train_end(self, step: int) -> None: ...
