"""`optimus chaos` ends the training jobs it started whatever ends it (optimus/resilience/chaos.py)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from optimus.resilience.chaos import _Run, ending_jobs_on_exit


def _sleeping_run(tmp_path: Path) -> _Run:
    run = _Run([sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "run", 1, dict(os.environ),
               tmp_path / "run.log")
    run.launch()
    return run


@pytest.mark.parametrize("how", ["error", "sigterm"])
def test_the_jobs_end_with_the_harness(tmp_path, how):
    """The audit's `timeout 120 optimus chaos ...` left torchrun and its workers training as orphans: each job runs
    in a session of its own, so the harness's SIGTERM never reached them. An error or a SIGTERM now ends them; the
    SIGTERM becomes SystemExit(143), the status a killed process would have had."""
    run, idle = _sleeping_run(tmp_path), _Run(["true"], tmp_path / "idle", 1, {}, tmp_path / "idle.log")
    previous = signal.getsignal(signal.SIGTERM)
    expected = RuntimeError if how == "error" else SystemExit
    with pytest.raises(expected) as ended:
        with ending_jobs_on_exit([run, idle]):  # (a run never launched is left alone)
            if how == "error":
                raise RuntimeError("the harness failed")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # (the handler raises at once; this only bounds the wait if it did not)
    if how == "sigterm":
        assert ended.value.code == 143
    assert run.job.poll() == -signal.SIGKILL
    assert signal.getsignal(signal.SIGTERM) == previous


def test_a_harness_that_ends_normally_leaves_no_job_running(tmp_path):
    """(run_chaos waits for both jobs first: this only holds the line for a future early return.)"""
    run = _sleeping_run(tmp_path)
    with ending_jobs_on_exit([run]):
        pass
    assert run.job.poll() is not None
