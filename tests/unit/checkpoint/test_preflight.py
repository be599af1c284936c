"""A run directory checkpoints cannot be written to is refused at start-up, in one line."""

import shutil
from pathlib import Path

import pytest

from optimus.checkpoint.manager import CheckpointError, CheckpointManager
from optimus.checkpoint.preflight import RunDirError, check_run_dir


def test_a_usable_run_dir_is_created_and_left_clean(tmp_path):
    check_run_dir(tmp_path / "new" / "run", checkpoint_bytes=1000)
    assert [p.name for p in (tmp_path / "new" / "run").iterdir()] == ["checkpoints"]
    assert not list((tmp_path / "new" / "run" / "checkpoints").iterdir())


@pytest.mark.parametrize("make, expected", [
    (lambda run: run.write_text("x"), "is a file, not a directory"),
    (lambda run: (run.mkdir(), (run / "checkpoints").write_text("x")), "checkpoints' is a file"),
    (lambda run: (run.mkdir(), (run / "latest").mkdir()), "latest' is not a file"),
])
def test_unusable_run_dirs(tmp_path, make, expected):
    run = tmp_path / "run"
    make(run)
    with pytest.raises(RunDirError, match=expected) as err:
        check_run_dir(run, checkpoint_bytes=1000)
    assert "\n" not in str(err.value)


def test_unwritable_place(tmp_path):
    with pytest.raises(RunDirError, match="cannot write checkpoints under run.dir '/proc/optimus-run'"):
        check_run_dir(Path("/proc/optimus-run"), checkpoint_bytes=1000)


def test_not_enough_free_space(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(RunDirError, match=r"free under .* a checkpoint of this model takes about"):
        check_run_dir(tmp_path, checkpoint_bytes=free * 4)


def test_manager_preflight_raises_checkpoint_error(tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        CheckpointManager(tmp_path / "run").preflight(checkpoint_bytes=1)
