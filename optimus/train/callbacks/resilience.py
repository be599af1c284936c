"""Resilience as callbacks: too many skipped steps in a row stop the run, slow ranks are reported,
a preemption signal checkpoints and stops every rank at the same step, a hang is detected."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from optimus.resilience.guards import ConsecutiveSkips, LossSpikeGuard
from optimus.resilience.signals import PreemptionSignals, signal_name
from optimus.resilience.stragglers import Straggler, StragglerMonitor
from optimus.resilience.watchdog import HangWatchdog
from optimus.train.callbacks.base import Callback

if TYPE_CHECKING:
    from optimus.train.trainer import Trainer


class SkippedSteps(Callback):
    """A skipped step is logged whatever the cadence; too many in a row raise TooManySkippedSteps
    (after the step's record is written). The loss-spike guard itself runs inside the step."""

    def __init__(self, consecutive: ConsecutiveSkips, spike_guard: LossSpikeGuard | None):
        self.consecutive = consecutive
        self.spike_guard = spike_guard
        self._result = None

    def on_step_result(self, step: int, result: Any) -> bool:
        self._result = result
        return result.skipped

    def after_step(self, step: int) -> None:
        result = self._result
        detail = self._describe(result) if result.skipped else ""
        self.consecutive.update(step, result.skip_reason, detail)  # raises after too many in a row

    def _describe(self, result: Any) -> str:
        if result.skip_reason == "loss spike" and self.spike_guard is not None:
            return self.spike_guard.describe(result.loss)
        return f"loss {result.loss:.4g}, gradient norm {result.grad_norm:.4g}"


class StragglerReport(Callback):
    """Times each step on every rank; when the monitor finds slow ranks, that step is logged with them
    (`stragglers`). Without a monitor (one process, or resilience.straggler_every=0) it does nothing."""

    def __init__(self, monitor: StragglerMonitor | None):
        self.monitor = monitor
        self._timing = None
        self._found: list[Straggler] | None = None

    def on_step_start(self, step: int) -> None:
        if self.monitor is not None:
            self._timing = self.monitor.timed_step()
            self._timing.__enter__()

    def on_step_result(self, step: int, result: Any) -> bool:
        if self.monitor is None:
            return False
        if self._timing is not None:
            self._timing.__exit__(None, None, None)
            self._timing = None
        self._found = self.monitor.check(step)  # collective at the monitor's steps
        return bool(self._found)

    def on_log(self, step: int, result: Any, record: dict[str, Any]) -> None:
        if self._found:
            record["stragglers"] = [s.as_record() for s in self._found]
        self._found = None


class PreemptionCheckpoint(Callback):
    """resilience.checkpoint_on_signal: while training, SIGTERM/SIGUSR1... are caught; at the next step
    boundary, when any rank got one, every rank commits a checkpoint of that step and the run stops
    (that step's scheduled evaluation is skipped). Not after the last step: it is checkpointed anyway."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self._signals: PreemptionSignals | None = None

    def on_train_start(self, start_step: int, max_steps: int) -> None:
        self._signals = PreemptionSignals().__enter__()

    def after_step(self, step: int) -> None:
        trainer = self.trainer
        if self._signals is None or step == trainer.config.train.max_steps:
            return
        signum = self._signals.received_on_any_rank(trainer.device)
        if not signum:
            return
        trainer.checkpointing.save(step)
        trainer.checkpointing.commit_pending()  # an asynchronous save must be on disk before the process ends
        trainer.dispatch("on_progress", step)
        name = signal_name(signum)
        if trainer.is_rank0:
            print(f"{name} at step {step}: checkpoint saved, exiting; rerun the same command to resume",
                  file=sys.stderr, flush=True)
        trainer.stop(name)

    def on_train_end(self, step: int) -> None:
        if self._signals is not None:
            self._signals.__exit__(None, None, None)
            self._signals = None


class HangWatch(Callback):
    """resilience.hang_timeout_s: a watchdog thread ends the job when the loop makes no progress (no
    step, evaluation or checkpoint finished) for that long, e.g. a collective waiting on a dead rank."""

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s, self.rank = timeout_s, rank
        self._watchdog: HangWatchdog | None = None

    def on_train_start(self, start_step: int, max_steps: int) -> None:
        self._watchdog = HangWatchdog(self.timeout_s, self.rank).__enter__()

    def on_progress(self, step: int) -> None:
        if self._watchdog is not None:
            self._watchdog.beat(step)

    def on_train_end(self, step: int) -> None:
        if self._watchdog is not None:
            self._watchdog.__exit__(None, None, None)
            self._watchdog = None
