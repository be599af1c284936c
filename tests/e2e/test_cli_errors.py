"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing good overwritten."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from optimus.cli import main
from tests.e2e.conftest import run_cli, tiny_config


def fail_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def snapshot(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "metrics.jsonl"
    }


def write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_config_mistakes(capsys, tmp_path, token_dir):
    cfg = write(tmp_path, tiny_config(token_dir))
    assert "unknown config key 'train.max_step'" in fail_line(capsys, ["train", cfg, "--train.max_step=3"])
    assert "unknown model.preset" in fail_line(capsys, ["train", cfg, "--model.preset=gpt-9"])
    assert "not found" in fail_line(capsys, ["train", str(tmp_path / "nope.yaml")])
    assert "bad value for 'optim.lr'" in fail_line(capsys, ["train", cfg, "--optim.lr=fast"])
    assert "world size" in fail_line(capsys, ["train", cfg, "--parallel.dp_shard=2"])
    assert "not divisible by train.micro_batch_size (4)" in fail_line(capsys, ["train", cfg, "--parallel.dp_shard=4"])


def test_data_mistakes(capsys, tmp_path, token_dir):
    missing = tiny_config(token_dir, data={"sources": [{"path": str(tmp_path / "absent")}]})
    assert "absent" in fail_line(capsys, ["train", write(tmp_path, missing), f"--run.dir={tmp_path / 'r'}"])

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.bin").write_bytes(b"")
    meta = {"dtype": "uint16", "tokens": 0, "documents": 0, "tokenizer_sha256": "x", "eos_id": 50279, "vocab_size": 50280}
    (empty / "train.json").write_text(yaml.safe_dump(meta))
    no_tokens = tiny_config(token_dir, data={"sources": [{"path": str(empty)}]})
    fail_line(capsys, ["train", write(tmp_path, no_tokens), f"--run.dir={tmp_path / 'r'}"])

    small_vocab = tiny_config(token_dir)
    err = fail_line(capsys, ["train", write(tmp_path, small_vocab), "--model.vocab_size=1000", f"--run.dir={tmp_path / 'r'}"])
    assert "vocab" in err
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_damaged_or_foreign_checkpoint_is_refused_and_kept(capsys, tmp_path, token_dir):
    run = tmp_path / "run"
    cfg = write(tmp_path, tiny_config(token_dir, train={"max_steps": 2, "ckpt_every": 2, "eval_every": 0}))
    assert main(["train", cfg, f"--run.dir={run}", "--no-progress"]) == 0
    capsys.readouterr()
    before = snapshot(run)

    err = fail_line(capsys, ["train", cfg, f"--run.dir={run}", "--train.max_steps=4", "--model.d_model=128"])
    assert "different model" in err and "d_model" in err
    assert snapshot(run) == before

    shard = next((run / "checkpoints" / "step-2").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    before = snapshot(run)
    err = fail_line(capsys, ["train", cfg, f"--run.dir={run}", "--train.max_steps=4"])
    assert "damaged" in err and "step-2" in err
    assert snapshot(run) == before
    assert fail_line(capsys, ["generate", str(run), "--prompt", "Hello"])


def test_run_dir_mistakes(capsys, tmp_path):
    assert "not a run directory" in fail_line(capsys, ["eval", str(tmp_path)])
    assert "not a run directory" in fail_line(capsys, ["export", str(tmp_path), "--format", "hf", "--out", str(tmp_path / "o")])


def test_subprocess_error_has_no_traceback(tmp_path):
    result = run_cli("train", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
