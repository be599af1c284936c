"""A run whose ranks split the experts logs the busiest rank's share of each layer's token copies."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _train_two_steps(rank: int, world: int, run_dir: str, token_dir: str):
    import os

    from optimus.config import build_config
    from optimus.train.trainer import Trainer
    from tests.helpers.runs import tiny_run_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # as torchrun would
    model = dict(n_layers=2, n_experts=4, top_k=2, expert_ffn_hidden=32)
    config = build_config(tiny_run_config(run_dir, token_dir, train=dict(max_steps=2, ckpt_every=0,
                                                                         global_batch_size=4),
                                          model=model, parallel=dict(dp_shard=2, ep=2)))
    Trainer(config, progress_bar=False).fit()


def test_expert_parallel_run_logs_the_busiest_ranks_share_of_its_logged_counts(tmp_path, small_token_dir):
    from optimus.train.metrics import busiest_block_share

    run_distributed(_train_two_steps, 2, str(tmp_path), str(small_token_dir), timeout=90)
    steps = [row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    assert len(steps) == 2
    for row in steps:
        shares = busiest_block_share(torch.tensor(row["expert_counts"]), 2)  # ep 2: two blocks of 2 experts
        assert row["expert_rank_load_mean"] == pytest.approx(shares.mean().item(), abs=1e-4)
        assert row["expert_rank_load_max"] == pytest.approx(shares.max().item(), abs=1e-4)
        assert 1.0 <= row["expert_rank_load_mean"] <= row["expert_rank_load_max"] <= 2.0
