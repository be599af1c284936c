"""Downstream scoring split over gloo ranks gives the numbers one process gives."""

from __future__ import annotations

import torch

from tests.unit.eval.planted import QUESTIONS, CharTokenizer, SuccessorModel


def _score_on_rank(rank: int, world: int, strength: float):
    import torch.distributed as dist

    from optimus.eval.scoring import score_questions

    tasks = {"count": QUESTIONS, "first_two": QUESTIONS[:2]}  # 19 requests: not a multiple of 2 or 3
    scores = score_questions(SuccessorModel(strength), CharTokenizer(), tasks, torch.device("cpu"), max_len=32,
                             batch_size=2, group=dist.group.WORLD)
    return {name: score.as_record() for name, score in scores.items()}


def test_ranks_split_the_requests_and_agree():
    from optimus.testing.distributed import run_distributed

    for strength, expected in [(10.0, 1.0), (-10.0, 0.0)]:
        for world in (2, 3):
            results = run_distributed(_score_on_rank, world, strength)
            assert all(r == results[0] for r in results)  # every rank holds every score
            for name, n in [("count", len(QUESTIONS)), ("first_two", 2)]:
                assert results[0][name] == {"acc": expected, "acc_norm": expected, "n": n}
