"""The hang watchdog ends a process that stops beating (with its message, every thread's stack and its exit
code), leaves alone one that keeps beating or has not started beating, and stops when told.

Each case runs in its own Python process: the watchdog ends its process with os._exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from optimus.resilience.watchdog import EXIT_HUNG


def run_python(body: str) -> subprocess.CompletedProcess:
    code = "import threading, time\nfrom optimus.resilience.watchdog import HangWatchdog\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_loop_that_stops_beating_is_aborted_with_its_stack():
    result = run_python("""
        def stuck_in_a_collective():
            time.sleep(30)

        watchdog = HangWatchdog(0.5, rank=3).start()
        watchdog.beat(7)
        stuck_in_a_collective()
        print("not aborted")
    """)
    assert result.returncode == EXIT_HUNG, result.stderr
    assert "not aborted" not in result.stdout
    assert "rank 3 made no progress for 0.5 s after step 7" in result.stderr
    assert "stuck_in_a_collective" in result.stderr  # the main thread's stack, where it hung
    assert "Current thread 0x" in result.stderr and "\nThread 0x" in result.stderr  # every thread's


def test_a_loop_that_keeps_beating_is_not_aborted_nor_one_not_yet_armed():
    result = run_python("""
        watchdog = HangWatchdog(0.3).start()
        time.sleep(1.0)  # no beat yet (start-up, first step): not armed
        for step in range(1, 31):
            time.sleep(0.05)
            watchdog.beat(step)
        watchdog.stop()
        print("finished")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "finished"


def test_stop_ends_the_thread_and_nothing_fires_afterwards():
    result = run_python("""
        watchdog = HangWatchdog(0.2).start()
        watchdog.beat(1)
        watchdog.stop()
        assert threading.active_count() == 1, threading.enumerate()
        time.sleep(0.8)  # four timeouts without a beat
        print("finished")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "finished"


def test_a_hung_process_exits_124_as_timeout_does():
    """Job scripts and torchrun logs tell a hang from a crash by the documented exit code 124 (timeout(1)'s)."""
    assert EXIT_HUNG == 124


def test_a_short_timeout_is_checked_at_least_four_times_per_timeout():
    """The watchdog fires at most a quarter timeout late: it polls every timeout/4 seconds, capped at 5 s for long
    timeouts (the interval the thread waits is recorded, not timed)."""
    from optimus.resilience.watchdog import HangWatchdog

    class RecordingStop:
        def __init__(self):
            self.waits = []

        def wait(self, seconds):
            self.waits.append(seconds)
            return True  # stopped: the loop ends after the first wait

    for timeout_s, poll_s in ((2.0, 0.5), (60.0, 5.0)):
        watchdog = HangWatchdog(timeout_s)
        watchdog._stopped = RecordingStop()
        watchdog._watch()
        assert watchdog._stopped.waits == [poll_s], timeout_s


def test_a_watchdog_timeout_of_zero_is_refused():
    import pytest

    from optimus.resilience.watchdog import HangWatchdog

    with pytest.raises(ValueError, match="timeout_s must be positive, got 0"):
        HangWatchdog(0)
