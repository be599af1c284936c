"""Hang watchdog: when training stops making progress, abort the process so the launcher restarts the job.

A rank stuck in a collective (a peer died, a network fault, a deadlock) waits forever by default, and the
job burns its allocation. The trainer calls `beat(step)` after every step, evaluation and checkpoint save;
a daemon thread ends the process when no beat arrived for `timeout_s`: one line on stderr naming the
rank, the last step and the timeout, every thread's Python stack (to see where it hung), then
`os._exit(EXIT_HUNG)`. torchrun and Slurm see a failed worker and restart the job, which resumes from
the last committed checkpoint.

The watchdog arms at the first beat: start-up, loading a checkpoint and the first step (which may
compile) can take much longer than a step. So the timeout must exceed the slowest step, evaluation or
checkpoint save after that. It runs in Python: a hang that holds the GIL (rare; collectives release it)
stops the watchdog too, and the communication library's own timeout has to catch it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

# As timeout(1) reports a command that ran past its limit; non-zero, so launchers treat it as a failure.
EXIT_HUNG = 124


class HangWatchdog:
    """A daemon thread that aborts the process when `beat()` is not called for `timeout_s` seconds."""

    def __init__(self, timeout_s: float, rank: int = 0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.rank = rank
        self._last_beat: float | None = None  # None until the first beat: not armed
        self._last_step: int | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="optimus-hang-watchdog", daemon=True)

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """Progress was made (`step` is the last completed step): restart the countdown."""
        self._last_step = step
        self._last_beat = time.monotonic()

    def stop(self) -> None:
        """Stop watching and wait for the thread to end."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _watch(self) -> None:
        poll_s = min(self.timeout_s / 4, 5.0)  # fires at most a quarter timeout late
        while not self._stopped.wait(poll_s):
            last = self._last_beat
            if last is not None and time.monotonic() - last > self.timeout_s:
                self._abort()

    def _abort(self) -> None:
        message = (f"optimus: rank {self.rank} made no progress for {self.timeout_s:g} s after step "
                   f"{self._last_step} (resilience.hang_timeout_s): aborting so the launcher restarts the job "
                   f"from the last checkpoint; every thread's stack follows\n")
        try:
            sys.stderr.flush()
        except Exception:  # a broken stderr must not keep a hung job alive
            pass
        # straight to file descriptor 2: sys.stderr may be a wrapper without a file descriptor
        os.write(2, message.encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
        os._exit(EXIT_HUNG)
