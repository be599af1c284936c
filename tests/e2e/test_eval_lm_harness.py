"""Cross-check with lm-evaluation-harness: its HF model wrapper scores our requests on the exported run.

Needs the lm-eval package (the `harness` extra, which `make test-slow` installs); skipped without it. It checks the
model side (tokenization, truncation to the window, log-likelihood sums) and the ranking on the same
requests; the prompts are OLMo's packaged ones, not lm-eval's own task templates.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.e2e.conftest import run_cli, tiny_config

pytestmark = pytest.mark.slow


def _rank(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda c: (scores[c], -c))


def test_lm_eval_harness_scores_our_requests_as_we_do(tmp_path, token_dir):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from optimus.cli import load_run
    from optimus.data.sources import load_tokenizer
    from optimus.eval.scoring import continuation_logliks, score_questions
    from optimus.eval.tasks import load_task

    run = tmp_path / "run"
    config = tiny_config(token_dir, train={"max_steps": 4, "ckpt_every": 4}, run={"dir": str(run)})
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    assert run_cli("train", str(tmp_path / "tiny.yaml")).returncode == 0
    assert run_cli("export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")).returncode == 0
    config, model = load_run(str(run))
    tokenizer = load_tokenizer(config.data.tokenizer)
    window = config.train.seq_len
    harness = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", batch_size=4, dtype="float32", max_length=window)
    for name in ["arc_easy", "copa", "winogrande", "piqa"]:  # piqa's pairs overflow the 64-token window
        questions = load_task(name, limit=16)
        pairs = [pair for q in questions for pair in zip(q.contexts, q.continuations)]
        requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                    for i, pair in enumerate(pairs)]
        theirs = [loglik for loglik, _ in harness.loglikelihood(requests, disable_tqdm=True)]
        encoded = [tuple(tokenizer.encode(text, add_special_tokens=False).ids for text in pair) for pair in pairs]
        ours = continuation_logliks(model, encoded, torch.device("cpu"), max_len=window, batch_size=4)
        assert ours == pytest.approx(theirs, abs=1e-3), name
        right = right_norm = first = 0
        for q in questions:  # lm-eval's acc and acc_norm (log-likelihood per character of the choice text)
            scores = theirs[first:first + len(q.continuations)]
            first += len(q.continuations)
            right += _rank(scores) == q.gold
            right_norm += _rank([s / len(c.lstrip(" ")) for s, c in zip(scores, q.continuations)]) == q.gold
        got = score_questions(model, tokenizer, {name: questions}, torch.device("cpu"), max_len=window)[name]
        assert abs(got.acc - right / len(questions)) <= 0.01 and abs(got.acc_norm - right_norm / len(questions)) <= 0.01
