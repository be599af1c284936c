"""`optimus train`'s own flags: bad values end in one line and exit code 2 before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.cli import main

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "mula-tiny-dense.yaml")


@pytest.mark.parametrize("memory", ["-1", "0", "nan", "inf"])
def test_a_dry_run_against_a_device_memory_that_is_not_positive_is_one_line(memory, capsys):
    code = main(["train", CONFIG, "--dry-run", "--world-size", "1", "--device-memory-gb", memory])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("optimus train: error: --device-memory-gb must be a positive number of GiB (got ")


def test_world_size_without_dry_run_is_refused_before_training(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", CONFIG, "--world-size", "4", f"--run.dir={run}", "--train.max_steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("optimus train: error: --world-size 4 applies with --dry-run only: add --dry-run, or ")
    assert not run.exists()  # refused before the trainer made anything
