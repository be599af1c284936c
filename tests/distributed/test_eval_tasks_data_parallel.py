"""Downstream scoring split over gloo ranks gives the numbers one process gives."""

from __future__ import annotations

import pytest
import torch

from tests.unit.eval.planted import QUESTIONS, CharTokenizer, SuccessorModel

pytestmark = pytest.mark.distributed


def _score_on_rank(rank: int, world: int, strength: float):
    import torch.distributed as dist

    from optimus.eval.scoring import score_questions

    tasks = {"count": QUESTIONS, "first_two": QUESTIONS[:2]}  # 19 requests: not a multiple of 2 or 3
    scores = score_questions(SuccessorModel(strength), CharTokenizer(), tasks, torch.device("cpu"), max_len=32,
                             batch_size=2, group=dist.group.WORLD)
    return {name: score.as_record() for name, score in scores.items()}


def test_ranks_split_the_requests_and_agree():
    from tests.helpers.distributed import run_distributed

    for strength, expected in [(10.0, 1.0), (-10.0, 0.0)]:
        for world in (2, 3):
            results = run_distributed(_score_on_rank, world, strength)
            assert all(r == results[0] for r in results)  # every rank holds every score
            for name, n in [("count", len(QUESTIONS)), ("first_two", 2)]:
                assert results[0][name] == {"acc": expected, "acc_norm": expected, "n": n}


def _downstream_on_fsdp_rank(rank: int, world: int, config):
    from optimus.eval.loop import downstream_accuracies
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model

    dims = ParallelDims(dp_shard=world, ep=world, world_size=world)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, torch.device("cpu"))
    return downstream_accuracies(model, config, torch.device("cpu"), mesh)


def test_the_training_loops_downstream_eval_under_fsdp_and_ep_matches_one_process():
    """The trainer's path: an FSDP + EP MoE model, the real tokenizer and packaged questions, dp slices."""
    from optimus.eval.loop import downstream_accuracies
    from optimus.models.transformer import build_model
    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import tiny_config

    # the real tokenizer's ids: the full vocabulary (tiny_config's default is smaller)
    config = tiny_config(moe=True, model=dict(vocab_size=50304), parallel=dict(dp_shard=2, ep=2),
                         train=dict(eval_tasks=["copa", "arc_easy"], eval_tasks_limit=5))
    one = downstream_accuracies(build_model(config.model, "cpu", seed=config.train.seed), config, torch.device("cpu"))
    results = run_distributed(_downstream_on_fsdp_rank, 2, config)
    assert results[0] == results[1] == one
    assert {name: record["n"] for name, record in one.items()} == {"copa": 5, "arc_easy": 5}
