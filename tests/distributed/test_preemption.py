"""A preemption signal that reaches only one rank stops every rank at the same step, after a checkpoint of it."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed

SIGNALLED_RANK, SIGNALLED_AFTER_STEP = 1, 3


def _train_until_signalled(rank: int, world: int, run_dir: str, token_dir: str):
    import os
    import signal

    from optimus.config import build_config
    from tests.helpers.runs import tiny_run_config
    from optimus.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # as torchrun would
    config = build_config(tiny_run_config(run_dir, token_dir,
                                          train=dict(global_batch_size=4, max_steps=8, ckpt_every=2),
                                          parallel=dict(dp_replicate=2)))
    trainer = Trainer(config, progress_bar=False)
    if rank == SIGNALLED_RANK:
        one_step = trainer._one_step

        def one_step_then_signal(step: int) -> None:
            one_step(step)
            if step == SIGNALLED_AFTER_STEP:
                os.kill(os.getpid(), signal.SIGUSR1)  # as if Slurm had signalled this rank's node only

        trainer._one_step = one_step_then_signal
    summary = trainer.fit()
    return summary.step, summary.stopped_by_signal


def test_a_signal_on_one_rank_stops_both_at_the_same_step(tmp_path, small_token_dir):
    stopped = run_distributed(_train_until_signalled, 2, str(tmp_path), str(small_token_dir), timeout=60)
    assert stopped == [(SIGNALLED_AFTER_STEP, "SIGUSR1")] * 2
    assert (tmp_path / "checkpoints" / f"step-{SIGNALLED_AFTER_STEP}" / "COMMITTED").exists()
    assert (tmp_path / "latest").read_text().strip() == str(SIGNALLED_AFTER_STEP)
