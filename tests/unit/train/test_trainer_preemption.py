"""The Trainer on a preemption signal: at the next step boundary it commits a checkpoint of that step (also
when checkpoints are asynchronous), stops, says so in its summary, and puts the signal handlers back."""

from __future__ import annotations

import os
import signal

import pytest

from optimus.checkpoint.manager import CheckpointManager
from optimus.config import build_config
from tests.helpers.runs import tiny_run_config
from optimus.train.callbacks import Callback
from optimus.train.trainer import Trainer


def tiny_config(run_dir, token_dir, **train):
    return build_config(tiny_run_config(run_dir, token_dir, train={**dict(max_steps=8, ckpt_every=2), **train}))


class SignalAtStep(Callback):
    """Sends this process `signum` when `step` ends, as Slurm or torchrun would at any moment."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum, self.steps_seen, self.evaluated = step, signum, [], []

    def on_step_end(self, step, metrics):
        self.steps_seen.append(step)
        if step == self.step:
            # only while the trainer catches it: a default handler would kill the test process
            assert signal.getsignal(self.signum) not in (signal.SIG_DFL, signal.SIG_IGN, None)
            os.kill(os.getpid(), self.signum)

    def on_eval(self, step, metrics):
        self.evaluated.append(step)


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_a_signal_commits_a_checkpoint_at_the_next_step_boundary_and_stops(tmp_path, small_token_dir, async_checkpoint):
    handlers_before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    signaller = SignalAtStep(3, signal.SIGUSR1)
    summary = Trainer(tiny_config(tmp_path, small_token_dir, async_checkpoint=async_checkpoint, eval_every=3),
                      callbacks=[signaller]).fit()
    assert (summary.step, summary.stopped_by_signal) == (3, "SIGUSR1")
    assert signaller.steps_seen == [1, 2, 3]
    assert signaller.evaluated == [] and summary.heldout_loss is None  # step 3's scheduled evaluation is skipped
    checkpoints = CheckpointManager(tmp_path)
    assert checkpoints.committed_steps() == [2, 3] and checkpoints.latest() == 3
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == handlers_before


def test_with_checkpoint_on_signal_off_no_handler_is_installed(tmp_path, small_token_dir):
    class RecordHandler(Callback):
        def on_step_end(self, step, metrics):
            self.handler = signal.getsignal(signal.SIGTERM)

    config = tiny_config(tmp_path, small_token_dir, max_steps=1)
    config.resilience.checkpoint_on_signal = False
    record = RecordHandler()
    summary = Trainer(config, callbacks=[record]).fit()
    assert record.handler == signal.getsignal(signal.SIGTERM) and summary.stopped_by_signal is None


def test_a_signal_after_the_last_step_lets_the_run_end_as_it_would(tmp_path, small_token_dir):
    """The last step is checkpointed and evaluated anyway: the run ends normally, not as a preempted one."""
    signaller = SignalAtStep(2, signal.SIGUSR1)
    summary = Trainer(tiny_config(tmp_path, small_token_dir, max_steps=2), callbacks=[signaller]).fit()
    assert (summary.step, summary.stopped_by_signal) == (2, None)
    assert summary.heldout_loss is not None and signaller.evaluated == [2]
    assert CheckpointManager(tmp_path).committed_steps() == [2]
