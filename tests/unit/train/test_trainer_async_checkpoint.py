"""The Trainer with train.async_checkpoint: training goes on while a checkpoint is written, callbacks
hear of a checkpoint once it is committed, and a failure mid-run keeps the checkpoint already written."""

from __future__ import annotations

import pytest

from optimus.checkpoint.manager import CheckpointManager
from optimus.config import build_config
from tests.helpers.runs import tiny_run_config
from optimus.train.callbacks import Callback
from optimus.train.trainer import Trainer


def async_config(run_dir, token_dir):
    return build_config(tiny_run_config(run_dir, token_dir,
                                        train=dict(max_steps=4, ckpt_every=2, async_checkpoint=True)))


class CommittedAtEachEvent(Callback):
    """Records which checkpoints are committed on disk whenever a step ends or a checkpoint is announced."""

    def __init__(self, run_dir, fail_at_step: int | None = None):
        self.manager, self.fail_at_step, self.events = CheckpointManager(run_dir), fail_at_step, []

    def on_step_end(self, step, metrics):
        self.events.append((f"step {step}", self.manager.committed_steps()))
        if step == self.fail_at_step:
            raise RuntimeError("training failed")

    def on_checkpoint(self, step):
        self.events.append((f"checkpoint {step}", self.manager.committed_steps()))


def test_checkpoints_are_announced_when_committed_and_training_goes_on_meanwhile(tmp_path, small_token_dir):
    log = CommittedAtEachEvent(tmp_path)
    Trainer(async_config(tmp_path, small_token_dir), callbacks=[log]).fit()
    assert log.events == [
        ("step 1", []), ("step 2", []),
        ("step 3", []),  # step 2's checkpoint is still being written
        ("step 4", []), ("checkpoint 2", [2]), ("checkpoint 4", [2, 4]),
    ]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_failure_mid_run_keeps_the_checkpoint_that_was_being_written(tmp_path, small_token_dir):
    log = CommittedAtEachEvent(tmp_path, fail_at_step=3)
    with pytest.raises(RuntimeError, match="training failed"):
        Trainer(async_config(tmp_path, small_token_dir), callbacks=[log]).fit()
    assert log.events[-1] == ("checkpoint 2", [2])
    assert CheckpointManager(tmp_path).latest() == 2
