"""Through the CLI: a checkpoint carrying a pickle payload runs nothing; a bit-flipped one is named by eval and
verify, and training resumes from the previous one to the very same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from optimus.checkpoint.integrity import read_manifest
from optimus.cli import main
from tests.e2e.conftest import run_cli, train_tiny_run
from tests.unit.checkpoint.tampering import flip_bytes_in_item, plant_payload


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, token_dir) -> tuple[Path, Path]:
    """(config, run dir) of a 4-step tiny run with checkpoints at steps 2 and 4."""
    cfg, run = train_tiny_run(tmp_path_factory.mktemp("safety"), token_dir, max_steps=4)
    assert not (run / "loss.png").exists()  # train.loss_plot=false (tiny_config) draws none
    return cfg, run


def copy_run(two_checkpoints, tmp_path) -> tuple[Path, Path]:
    cfg, run = two_checkpoints
    shutil.copytree(run, tmp_path / "run")
    return cfg, tmp_path / "run"


def one_line(capsys, argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_payload_checkpoint_runs_nothing_for_any_verb(two_checkpoints, tmp_path, capsys):
    cfg, run = copy_run(two_checkpoints, tmp_path)
    marker = tmp_path / "marker"
    plant_payload(run / "checkpoints" / "step-4", "model.embed.weight", marker)
    capsys.readouterr()
    for argv in (["eval", str(run), "--batches", "1"], ["generate", str(run), "--prompt", "Hi"],
                 ["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")],
                 ["train", str(cfg), f"--run.dir={run}", "--train.max_steps=6", "--no-progress"]):
        err = one_line(capsys, argv)
        assert "'model.embed.weight' as pickled bytes where a tensor belongs" in err, (argv[0], err)
        assert not marker.exists(), argv[0]
    assert not (tmp_path / "hf").exists()
    # sizes and hashes were forged to match, but verify sees a pickled item, which Optimus never writes
    assert main(["verify", str(run)]) == 2
    assert "pickled item 'model.embed.weight'" in capsys.readouterr().out
    # a subprocess too, as a user runs it: one line, exit 2, nothing ran
    result = run_cli("eval", str(run), "--batches", "1")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not marker.exists()


def test_flipped_weight_is_named_and_resume_uses_the_previous_checkpoint(two_checkpoints, tmp_path, capsys):
    cfg, run = copy_run(two_checkpoints, tmp_path)
    newest = run / "checkpoints" / "step-4"
    original, before = read_manifest(newest), losses(run)
    shard = flip_bytes_in_item(newest, "model.embed.weight")
    capsys.readouterr()

    assert main(["verify", str(run)]) == 2
    captured = capsys.readouterr()
    assert "step-2" in captured.out and "ok" in captured.out and f"'{shard.name}' does not match" in captured.out
    assert "1 of 2 checkpoints are bad: step-4" in captured.err

    err = one_line(capsys, ["eval", str(run), "--batches", "1"])
    assert "step-4 is damaged" in err and f"'{shard.name}' does not match its BLAKE2b hash" in err

    assert main(["train", str(cfg), f"--run.dir={run}", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "resuming from step 2: skipped checkpoint step-4 (file" in err and "damaged-step-4" in err
    assert (run / "checkpoints" / "damaged-step-4" / shard.name).read_bytes() != (newest / shard.name).read_bytes()
    # steps 3 and 4 trained again from step 2 give the very same files as the first time (bit-exact resume;
    # DCP's index differs only in the save's id and path)
    again = read_manifest(newest)
    assert {n: r for n, r in again.items() if n != ".metadata"} == {n: r for n, r in original.items() if n != ".metadata"}
    assert losses(run) == before and len(before) == 4


def losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def test_a_config_yaml_in_a_fresh_run_dir_is_kept_not_overwritten(two_checkpoints, tmp_path, capsys):
    """Training a folder's own config.yaml into that folder (no checkpoint yet) rewrote the file, the user's
    source with its comments, as the resolved config: it is kept as config-before-step-0.yaml, and said."""
    cfg, _ = copy_run(two_checkpoints, tmp_path)
    run = tmp_path / "mine"
    run.mkdir()
    mine = cfg.read_text() + "# my notes on this experiment\n"
    (run / "config.yaml").write_text(mine)
    assert main(["train", str(run / "config.yaml"), f"--run.dir={run}", "--train.max_steps=1", "--no-progress"]) == 0
    assert "run.dir held a config.yaml unlike this run's (and no checkpoint): it is kept as config-before-step-0.yaml" \
        in capsys.readouterr().err
    assert (run / "config-before-step-0.yaml").read_text() == mine


def test_a_metrics_log_in_a_run_dir_without_this_runs_config_is_kept(two_checkpoints, tmp_path, capsys):
    """A folder holding another run's metrics.jsonl and no checkpoint (its checkpoints deleted, or a folder of the
    user's): starting afresh rewound the log to step 0, dropping every record. It is kept, and said; a run restarted
    before its first checkpoint (its own config.yaml) still rewinds its own log instead."""
    cfg, _ = copy_run(two_checkpoints, tmp_path)
    run = tmp_path / "other"
    run.mkdir()
    theirs = '{"step": 1, "loss": 9.5}\n{"step": 2, "loss": 9.25}\n'
    (run / "metrics.jsonl").write_text(theirs)
    argv = ["train", str(cfg), f"--run.dir={run}", "--train.max_steps=1", "--train.ckpt_every=100",
            "--train.log_every=1", "--no-progress"]
    assert main(argv) == 0
    assert "run.dir held a metrics.jsonl of another run (and no checkpoint): it is kept as " \
        "metrics-before-step-0.jsonl" in capsys.readouterr().err
    assert (run / "metrics-before-step-0.jsonl").read_text() == theirs
    assert [step for step, _ in losses(run)] == [1]

    for name in run.iterdir():  # keep config.yaml (now this run's) and the new log only: a restart, no checkpoint
        if name.name not in ("config.yaml", "metrics.jsonl"):
            shutil.rmtree(name) if name.is_dir() else name.unlink()
    assert main(argv) == 0
    assert "metrics.jsonl of another run" not in capsys.readouterr().err
    assert [step for step, _ in losses(run)] == [1] and not list(run.glob("metrics-before-*"))


def test_resume_with_changed_settings_keeps_the_earlier_config_and_says_so(two_checkpoints, tmp_path, capsys):
    cfg, run = copy_run(two_checkpoints, tmp_path)
    assert main(["train", str(cfg), f"--run.dir={run}", "--train.max_steps=5", "--no-progress"]) == 0
    assert "settings changed" not in capsys.readouterr().err  # a longer run changes what no step computes
    assert not list(run.glob("config-before-*"))
    earlier = (run / "config.yaml").read_text()

    assert main(["train", str(cfg), f"--run.dir={run}", "--train.max_steps=6", "--optim.lr=0.0005",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "resuming from step 5 with settings changed since: optim.lr: 0.001 -> 0.0005" in err, err
    assert (run / "config-before-step-5.yaml").read_text() == earlier
    assert "lr: 0.0005" in (run / "config.yaml").read_text()
