"""Preemption signals: SIGTERM or SIGUSR1 -> checkpoint at the next step boundary, then exit cleanly.

Slurm sends SIGTERM before it kills a preempted job or one at its time limit (and SIGUSR1 ahead of time
with `#SBATCH --signal=USR1@120`); torchrun forwards SIGTERM to its workers and SIGKILLs them 30 s later;
PBS sends SIGTERM on `qdel` and at walltime. The handler only records the signal: a checkpoint cannot be
written from inside a signal handler, so the trainer asks `received_on_any_rank()` at each step
boundary, and every rank, having agreed on the same step, saves and stops.

Exit code 0: the run's state is saved and nothing failed. A non-zero code would make torchrun count a
worker failure (and restart it with --max-restarts on the very node being taken away) and Slurm mark
the job FAILED. Requeueing does not depend on it: Slurm requeues a preempted job by its own rules, and
before a time limit the batch script requeues the job once `srun` returns (`scontrol requeue
$SLURM_JOB_ID`). Rerunning the same command resumes from the checkpoint. (torchrun itself, when it is
the one signalled, still exits non-zero after its workers end: that is its own convention.)
"""

from __future__ import annotations

import signal
import threading
import warnings
from types import FrameType

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionSignals:
    """While installed (a `with` block), remembers the last preemption signal instead of dying of it."""

    def __init__(self) -> None:
        self.received = 0  # signal number; 0 = none
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionSignals:
        if threading.current_thread() is not threading.main_thread():
            # Python lets only the main thread install handlers: keep the default action (the job dies
            # at preemption, and a rerun resumes from the last periodic checkpoint).
            warnings.warn("training outside the main thread: preemption signals will not trigger a checkpoint",
                          stacklevel=2)
            return self
        for signum in PREEMPTION_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            # None: the previous handler was not installed from Python and cannot be put back as it was
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def received_on_any_rank(self, device: torch.device) -> int:
        """The signal received by any rank so far (0 = none); a collective on the default group when distributed.

        Every rank must call it at the same step, so that all of them stop at the same step.
        """
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.received
        # MAX over signal numbers: any rank's signal stops all (SIGTERM wins the name if both arrived)
        flag = torch.tensor([self.received], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
