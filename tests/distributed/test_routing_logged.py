"""A run whose ranks split the experts logs the busiest rank's share of each layer's token copies; where the
data-parallel ranks form several expert-exchange groups, the slowest group's, from the group's own tokens."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _train_two_steps(rank: int, world: int, run_dir: str, token_dir: str, dp_shard: int = 2):
    import os

    from optimus.config import build_config
    from optimus.train.trainer import Trainer
    from tests.helpers.runs import tiny_run_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # as torchrun would
    model = dict(n_layers=2, n_experts=4, top_k=2, expert_ffn_hidden=32)
    config = build_config(tiny_run_config(run_dir, token_dir, train=dict(max_steps=2, ckpt_every=0,
                                                                         global_batch_size=2 * dp_shard),
                                          model=model, parallel=dict(dp_shard=dp_shard, ep=2)))
    Trainer(config, progress_bar=False).fit()


def test_expert_parallel_run_logs_the_busiest_ranks_share_of_its_logged_counts(tmp_path, small_token_dir):
    from optimus.train.metrics import busiest_block_share

    run_distributed(_train_two_steps, 2, str(tmp_path), str(small_token_dir), timeout=90)
    steps = [row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    assert len(steps) == 2
    # tokens seen by the job, not by one rank: each step's global batch is 2 ranks x 2 sequences x 32 tokens
    assert [row["tokens_seen"] for row in steps] == [128, 256]
    for row in steps:
        # the global batch's routing summed over the ranks: each layer routes 128 tokens x top 2 copies
        assert torch.tensor(row["expert_counts"]).sum(dim=1).tolist() == [256, 256]
        shares = busiest_block_share(torch.tensor(row["expert_counts"]), 2)  # ep 2: two blocks of 2 experts
        assert row["expert_rank_load_mean"] == pytest.approx(shares.mean().item(), abs=1e-4)
        assert row["expert_rank_load_max"] == pytest.approx(shares.max().item(), abs=1e-4)
        assert 1.0 <= row["expert_rank_load_mean"] <= row["expert_rank_load_max"] <= 2.0


def _log_group_routing(rank: int, world: int) -> list[float]:
    from types import SimpleNamespace

    from optimus.parallel.mesh import ParallelDims
    from optimus.train.callbacks.step_metrics import ExpertLoadMetrics

    mesh = ParallelDims(dp_shard=4, ep=2, world_size=4).build_mesh("cpu")  # exchange groups: ranks {0, 1}, {2, 3}
    # 2 layers of 4 experts in 2 blocks: group {0, 1} sends all of layer 0's copies to block 0 (2.0x), group {2, 3}
    # three quarters to block 1 (1.5x); layer 1 even. Globally layer 0 reads 20 of an even 16 (1.25x)
    mine = [[4, 4, 0, 0], [2, 2, 2, 2]] if rank < 2 else [[1, 1, 3, 3], [2, 2, 2, 2]]
    counts = torch.tensor([[10, 10, 6, 6], [8, 8, 8, 8]])
    callback = ExpertLoadMetrics(expert_blocks=2, exchange_groups=(mesh["ep"], mesh["expert_dp"]))
    record: dict = {}
    callback.on_log(1, SimpleNamespace(expert_counts=counts, rank_expert_counts=torch.tensor(mine)), record)
    return [record["expert_rank_load_mean"], record["expert_rank_load_max"]]


def test_several_exchange_groups_log_the_slowest_groups_share_of_its_own_tokens():
    # the slowest group: layers' mean (2.0 + 1.0) / 2, worst layer 2.0 (the global counts would read 1.125, 1.25)
    assert run_distributed(_log_group_routing, 4, timeout=60) == [[1.5, 2.0]] * 4


def test_a_run_of_two_exchange_groups_reads_each_groups_routing(tmp_path, small_token_dir):
    """dp_shard 4 with ep 2: two groups of two ranks. Each group's busiest share is at least what the summed counts
    read (a sum of blocks evens out), so the logged shares are at least those of the global counts."""
    from optimus.train.metrics import busiest_block_share

    run_distributed(_train_two_steps, 4, str(tmp_path), str(small_token_dir), 4, timeout=120)
    steps = [row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    assert len(steps) == 2
    above = 0
    for row in steps:
        shares = busiest_block_share(torch.tensor(row["expert_counts"]), 2)
        assert row["expert_rank_load_mean"] >= shares.mean().item() - 1e-4
        assert row["expert_rank_load_max"] >= shares.max().item() - 1e-4
        above += row["expert_rank_load_mean"] > shares.mean().item() + 1e-4
    assert above, "no step read a group busier than the global counts: the groups' own counts were not used"
