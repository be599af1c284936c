"""The log-likelihood ranker on models whose answers are known, so every score checked here is earned.

A character-level stub tokenizer and a "successor" bigram model: after character c it puts a large
logit on chr(ord(c) + 1). A continuation that keeps counting up ("abc" -> "defg") is likely; any
other is not. Reversing the sign makes the model prefer everything but the successor.
"""

from __future__ import annotations

import pytest
import torch

from optimus.eval.scoring import _rank_slice, continuation_logliks, score_questions
from optimus.eval.tasks import Question
from optimus.models.config import ModelConfig
from optimus.models.transformer import build_model
from tests.unit.eval.planted import QUESTIONS, VOCAB, CharTokenizer, SuccessorModel


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_a_model_that_knows_the_answers_scores_one(batch_size):
    scores = score_questions(SuccessorModel(10.0), CharTokenizer(), {"count": QUESTIONS}, torch.device("cpu"),
                             max_len=32, batch_size=batch_size)
    assert scores["count"].acc == 1.0 and scores["count"].acc_norm == 1.0
    assert scores["count"].questions == len(QUESTIONS)


def test_the_reversed_preference_scores_zero():
    scores = score_questions(SuccessorModel(-10.0), CharTokenizer(), {"count": QUESTIONS}, torch.device("cpu"),
                             max_len=32, batch_size=4)
    assert scores["count"].acc == 0.0 and scores["count"].acc_norm == 0.0


def test_acc_norm_divides_by_characters():
    """A long continuation with one miss beats a short one with one miss only per character."""
    long = "defghijklmnop" + "a" + "bcdefghijklmno"  # 27 successors and 1 miss in 28 characters
    question = Question(contexts=("abc", "abc"), continuations=("dq", long), gold=1)  # "dq": 1 of 2
    scores = score_questions(SuccessorModel(10.0), CharTokenizer(), {"t": [question]}, torch.device("cpu"),
                             max_len=64)
    assert scores["t"].acc == 0.0  # summed: the long one pays 27 near-zero log-probs more
    assert scores["t"].acc_norm == 1.0


def test_acc_norm_leaves_the_leading_space_out_of_the_characters(monkeypatch):
    """lm-eval's count: the answer's characters, not the space that joins it to the question. Planted
    log-likelihoods: " ab" -2.0 (-1.0 a character; -0.67 counting the space), " abcd" -3.6 (-0.9; -0.72)."""
    monkeypatch.setattr("optimus.eval.scoring.continuation_logliks", lambda model, requests, *a, **k: [-2.0, -3.6])
    question = Question(contexts=("Q:", "Q:"), continuations=(" ab", " abcd"), gold=1)
    scores = score_questions(SuccessorModel(10.0), CharTokenizer(), {"t": [question]}, torch.device("cpu"), max_len=16)
    assert scores["t"].acc == 0.0 and scores["t"].acc_norm == 1.0


def test_loglik_is_the_sum_over_continuation_tokens_only():
    model = SuccessorModel(10.0)
    hit = torch.log_softmax(10.0 * torch.nn.functional.one_hot(torch.tensor(1), VOCAB).float(), -1)[1].item()
    miss = torch.log_softmax(10.0 * torch.nn.functional.one_hot(torch.tensor(1), VOCAB).float(), -1)[2].item()
    # context [1, 5] then continuation [6, 7, 9]: hit, hit, miss; the context's own tokens are not counted
    got = continuation_logliks(model, [([1, 5], [6, 7, 9])], torch.device("cpu"), max_len=16)
    assert got == [pytest.approx(2 * hit + miss)]
    # a window shorter than the pair keeps the continuation and the nearest context token
    assert continuation_logliks(model, [([1, 2, 3, 5], [6, 7, 9])], torch.device("cpu"), max_len=3) == got


def test_padding_and_batching_do_not_change_a_real_models_scores():
    """A real (tiny, random) Transformer: the right-padded batch gives each request's unbatched score."""
    torch.manual_seed(0)
    config = ModelConfig(d_model=32, n_layers=2, n_heads=4, vocab_size=VOCAB, n_experts=0, ffn_hidden=64)
    model = build_model(config, device="cpu")
    generator = torch.Generator().manual_seed(1)
    lengths = [(3, 2), (9, 4), (1, 1), (5, 7)]  # (context, continuation) tokens
    requests = [(torch.randint(0, VOCAB, (n,), generator=generator).tolist(),
                 torch.randint(0, VOCAB, (m,), generator=generator).tolist()) for n, m in lengths]
    alone = [continuation_logliks(model, [r], torch.device("cpu"), max_len=32)[0] for r in requests]
    batched = continuation_logliks(model, requests, torch.device("cpu"), max_len=32, batch_size=4)
    assert batched == pytest.approx(alone, abs=1e-4)
    # widths rounded up for sequence parallelism: more padding, same scores
    padded = continuation_logliks(model, requests, torch.device("cpu"), max_len=32, batch_size=3, pad_multiple=8)
    assert padded == pytest.approx(alone, abs=1e-4)
    assert model.training  # switched back after scoring


def test_padded_widths_are_a_multiple_of_pad_multiple():
    """Sequence parallelism splits each batch's width over the TP ranks: every forward gets a multiple of the pad."""
    widths = []

    class Recording(SuccessorModel):
        def forward(self, input_ids):
            widths.append(input_ids.shape[1])
            return super().forward(input_ids)

    requests = [([1, 2, 3], [4, 5]), ([1] * 9, [2] * 4), ([7], [8]), ([1] * 5, [2] * 7)]  # 4, 12, 1 and 11 inputs
    continuation_logliks(Recording(10.0), requests, torch.device("cpu"), max_len=32, batch_size=1, pad_multiple=8)
    assert sorted(widths) == [8, 8, 16, 16]


@pytest.mark.parametrize("n, world", [(19, 2), (19, 3), (7, 4), (6, 3)])
def test_every_rank_gets_as_many_requests_when_they_do_not_divide(monkeypatch, n, world):
    """FSDP and EP forwards are collective: each rank scores the same number of requests (padded with request 0),
    and together the ranks cover every request."""
    monkeypatch.setattr("optimus.eval.scoring.dist.get_world_size", lambda group: world)
    slices = []
    for rank in range(world):
        monkeypatch.setattr("optimus.eval.scoring.dist.get_rank", lambda group, rank=rank: rank)
        slices.append(_rank_slice(n, group=object()))
    padded = -(-n // world) * world
    assert all(total == padded and len(mine) == padded // world for mine, total in slices)
    assert set().union(*(mine for mine, _ in slices)) == set(range(n))


def test_a_tie_goes_to_the_lowest_index_choice(monkeypatch):
    """As argmax does: choices with equal log-likelihoods (and lengths) are answered by the first of them."""
    monkeypatch.setattr("optimus.eval.scoring.continuation_logliks", lambda model, requests, *a, **k: [-2.0] * 3)
    first = Question(contexts=("Q:",) * 3, continuations=(" ab", " cd", " ef"), gold=0)
    last = Question(contexts=("Q:",) * 3, continuations=(" ab", " cd", " ef"), gold=2)
    for question, expected in [(first, 1.0), (last, 0.0)]:
        scores = score_questions(SuccessorModel(10.0), CharTokenizer(), {"t": [question]}, torch.device("cpu"),
                                 max_len=16)
        assert scores["t"].acc == expected and scores["t"].acc_norm == expected


def test_a_continuation_longer_than_the_window_scores_its_last_tokens():
    """max_len 3: of the continuation [6, 7, 20, 9, 10, 12] the last three are scored, each given the three tokens
    before it: 20 -> 9 (a miss), 9 -> 10 (a hit), 10 -> 12 (a miss)."""
    model = SuccessorModel(10.0)
    logprobs = torch.log_softmax(10.0 * torch.nn.functional.one_hot(torch.tensor(1), VOCAB).float(), -1)
    hit, miss = logprobs[1].item(), logprobs[2].item()
    got = continuation_logliks(model, [([5], [6, 7, 20, 9, 10, 12])], torch.device("cpu"), max_len=3)
    assert got == [pytest.approx(hit + 2 * miss)]


def test_the_model_scores_in_eval_mode():
    """Dropout or any train-only behaviour must be off while scoring (and the mode restored after)."""
    modes = []

    class Recording(SuccessorModel):
        def forward(self, input_ids):
            modes.append(self.training)
            return super().forward(input_ids)

    model = Recording(10.0).train()
    continuation_logliks(model, [([1, 2], [3])], torch.device("cpu"), max_len=8)
    assert modes == [False] and model.training


def test_a_model_scored_in_eval_mode_stays_in_eval_mode():
    """The mode is restored, not set to training: an evaluation of a model in eval mode leaves it so."""
    model = SuccessorModel(10.0).eval()
    continuation_logliks(model, [([1, 2], [3])], torch.device("cpu"), max_len=8)
    assert not model.training


def test_a_continuation_of_only_a_space_counts_as_one_character(monkeypatch):
    """" " has no character past its leading space: divided by 1, not by 0. Planted log-likelihoods: " " -0.5,
    " ab" -3.0 (-1.5 a character)."""
    monkeypatch.setattr("optimus.eval.scoring.continuation_logliks", lambda model, requests, *a, **k: [-0.5, -3.0])
    question = Question(contexts=("Q:", "Q:"), continuations=(" ", " ab"), gold=0)
    scores = score_questions(SuccessorModel(10.0), CharTokenizer(), {"t": [question]}, torch.device("cpu"), max_len=16)
    assert scores["t"].acc == 1.0 and scores["t"].acc_norm == 1.0


def test_a_task_with_no_questions_scores_zero_of_zero():
    scores = score_questions(SuccessorModel(10.0), CharTokenizer(), {"none": [], "count": QUESTIONS[:1]},
                             torch.device("cpu"), max_len=32)
    assert scores["none"].as_record() == {"acc": 0.0, "acc_norm": 0.0, "n": 0} and scores["count"].acc == 1.0


def test_the_table_gives_each_task_its_questions_and_accuracies_in_percent_to_one_decimal():
    from optimus.eval.scoring import TaskScore, format_table

    table = format_table({"arc_easy": TaskScore(acc=0.5, acc_norm=0.33333, questions=12)})
    assert table.splitlines() == ["task                  n      acc  acc_norm",
                                  "arc_easy             12    50.0%     33.3%"]
