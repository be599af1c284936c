"""The training loop's held-out loss is the same set's whatever the layout: the data-parallel ranks split it."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed

MOE = dict(n_experts=4, top_k=2, expert_ffn_hidden=32, n_layers=2)
DENSE = dict(n_layers=2)


def _heldout_loss(rank: int, world: int, run_dir: str, token_dir: str, model: dict, parallel: dict | None):
    import os

    from optimus.config import build_config
    from optimus.train.trainer import Trainer
    from tests.helpers.runs import tiny_run_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # as torchrun would
    # micro-batch left to the layout: 4 on one process, 2 on each of 2 data-parallel replicas (1 under pp: 2 in flight)
    train = dict(global_batch_size=4, micro_batch_size=None, eval_batches=3, max_steps=2, ckpt_every=0)
    config = build_config(tiny_run_config(run_dir, token_dir, train=train, model=model, parallel=parallel))
    trainer = Trainer(config, progress_bar=False)
    trainer.fit()
    return trainer.evaluation.last_loss, sum(x.numel() for x, _ in trainer.evaluation.heldout())


# make test: the MoE layout and the pipelined one (which also replicates); replication alone in make test-slow
@pytest.mark.parametrize("model, parallel, world", [
    pytest.param(DENSE, dict(dp_replicate=2), 2, marks=pytest.mark.slow), (MOE, dict(dp_shard=2, ep=2), 2),
    (DENSE, dict(dp_replicate=2, pp=2), 4),
], ids=["dense-ddp2", "moe-fsdp2-ep2", "dense-ddp2-pp2"])
def test_data_parallel_ranks_give_the_one_process_heldout_loss(tmp_path, small_token_dir, model, parallel, world):
    (one_loss, one_tokens), = run_distributed(_heldout_loss, 1, str(tmp_path / "one"), str(small_token_dir), model,
                                              None, timeout=120)
    ranks = run_distributed(_heldout_loss, world, str(tmp_path / "many"), str(small_token_dir), model, parallel,
                            timeout=120)
    assert one_tokens == 3 * 4 * 32  # eval_batches global batches of 32-token windows
    assert [tokens for _, tokens in ranks] == [one_tokens // 2] * world  # each data-parallel replica holds half
    for loss, _ in ranks:  # fp32; the parity tolerance of losses after the first step
        assert loss == pytest.approx(one_loss, rel=1e-4)
