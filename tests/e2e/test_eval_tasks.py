"""`optimus eval RUN --tasks ...` and `train.eval_tasks` on a tiny trained run (scores are only range-checked:
an 8-step model has earned no accuracy to assert)."""

from __future__ import annotations

import json

import yaml

from optimus.cli import main
from optimus.train.callbacks import read_metrics

from tests.e2e.conftest import run_cli, tiny_config


def test_train_with_eval_tasks_then_eval_tasks_cli(tmp_path, token_dir, capsys):
    # both verbs in this process (main() is the CLI less the interpreter's start-up, ~7 s of imports each);
    # test_unknown_task_is_one_line_and_exit_2 runs `optimus eval --tasks` as a real process
    run = tmp_path / "run"
    config = tiny_config(token_dir, train={"max_steps": 4, "eval_every": 2, "ckpt_every": 4,
                                           "eval_tasks": ["arc_easy", "copa"], "eval_tasks_limit": 4},
                         run={"dir": str(run)})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path), "--no-progress"]) == 0, capsys.readouterr().err
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "downstream" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for record in evals:
        assert set(record["downstream"]) == {"arc_easy", "copa"}
        for score in record["downstream"].values():
            assert score["n"] == 4 and 0.0 <= score["acc"] <= 1.0 and 0.0 <= score["acc_norm"] <= 1.0

    capsys.readouterr()
    tasks = ["arc_easy", "copa", "hellaswag", "winogrande"]
    assert main(["eval", str(run), "--tasks", ",".join(tasks), "--limit", "4"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    written = json.loads((run / "eval_tasks.json").read_text())
    assert list(written) == tasks
    for name, score in written.items():
        assert score["n"] == 4 and 0.0 <= score["acc"] <= 1.0 and 0.0 <= score["acc_norm"] <= 1.0
        assert f"{name} " in printed
    # the step-4 in-loop score and the CLI's score of the same weights agree on the questions both saw
    assert {name: written[name] for name in ("arc_easy", "copa")} == evals[-1]["downstream"]


def test_unknown_task_is_one_line_and_exit_2(tmp_path):
    done = run_cli("eval", str(tmp_path), "--tasks", "arc_easy,nope")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "optimus eval: error: unknown downstream task 'nope': choose from arc_easy, arc_challenge, boolq, copa, "
        "csqa, hellaswag, openbookqa, piqa, sciq, socialiqa, winogrande"]
