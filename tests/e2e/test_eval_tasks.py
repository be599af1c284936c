"""`optimus eval RUN --tasks ...` and `train.eval_tasks` on a tiny trained run (scores are only range-checked:
an 8-step model has earned no accuracy to assert)."""

from __future__ import annotations

import json

import yaml

from optimus.train.callbacks import read_metrics

from tests.e2e.conftest import run_cli, tiny_config


def test_train_with_eval_tasks_then_eval_tasks_cli(tmp_path, token_dir):
    run = tmp_path / "run"
    config = tiny_config(token_dir, train={"max_steps": 4, "eval_every": 2, "ckpt_every": 4,
                                           "eval_tasks": ["arc_easy", "copa"], "eval_tasks_limit": 4},
                         run={"dir": str(run)})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    trained = run_cli("train", str(path))
    assert trained.returncode == 0, trained.stderr
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "downstream" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for record in evals:
        assert set(record["downstream"]) == {"arc_easy", "copa"}
        for score in record["downstream"].values():
            assert score["n"] == 4 and 0.0 <= score["acc"] <= 1.0 and 0.0 <= score["acc_norm"] <= 1.0

    done = run_cli("eval", str(run), "--tasks", "arc_easy,hellaswag,winogrande", "--limit", "8")
    assert done.returncode == 0, done.stderr
    written = json.loads((run / "eval_tasks.json").read_text())
    assert list(written) == ["arc_easy", "hellaswag", "winogrande"]
    for name, score in written.items():
        assert score["n"] == 8 and 0.0 <= score["acc"] <= 1.0 and 0.0 <= score["acc_norm"] <= 1.0
        assert f"{name} " in done.stdout
    # the step-4 in-loop score and the CLI's score of the same weights agree on the questions both saw
    four = run_cli("eval", str(run), "--tasks", "arc_easy,copa", "--limit", "4")
    assert four.returncode == 0, four.stderr
    assert json.loads((run / "eval_tasks.json").read_text()) == evals[-1]["downstream"]


def test_unknown_task_is_one_line_and_exit_2(tmp_path):
    done = run_cli("eval", str(tmp_path), "--tasks", "arc_easy,nope")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "optimus eval: error: unknown downstream task 'nope': choose from arc_easy, arc_challenge, boolq, copa, "
        "csqa, hellaswag, openbookqa, piqa, sciq, socialiqa, winogrande"]
