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


def test_the_size_the_trainer_reserves_is_what_a_checkpoint_of_weights_and_adam_moments_takes(tmp_path):
    """The free-space check is only as good as its estimate: a real checkpoint (fp32 weights and both AdamW
    moments, after a step) is within 10% of CHECKPOINT_BYTES_PER_PARAMETER per parameter."""
    import torch
    from torch import nn

    from optimus.checkpoint.preflight import CHECKPOINT_BYTES_PER_PARAMETER
    from optimus.train.state import ModelState, OptimizerState

    model = nn.Linear(512, 512)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}, {})
    written = sum(path.stat().st_size for path in manager.step_dir(1).iterdir())
    estimate = sum(p.numel() for p in model.parameters()) * CHECKPOINT_BYTES_PER_PARAMETER
    assert written == pytest.approx(estimate, rel=0.1)


@pytest.mark.parametrize("n, text", [(0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                     (1536, "1.5 KiB"), (3 * 1024 ** 2, "3.0 MiB"), (5 * 1024 ** 5, "5120.0 TiB")])
def test_human_bytes_units(n, text):
    from optimus.checkpoint.preflight import human_bytes

    assert human_bytes(n) == text


def test_exactly_enough_free_space_is_enough(tmp_path, monkeypatch):
    from optimus.checkpoint import preflight

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda _path: usage._replace(free=5000))
    check_run_dir(tmp_path, checkpoint_bytes=5000)
    with pytest.raises(RunDirError, match="only 4.9 KiB free"):
        check_run_dir(tmp_path, checkpoint_bytes=5001)


def test_the_probe_writes_real_bytes_to_disk(tmp_path, monkeypatch):
    """An empty probe file would not notice a full disk: the probe writes (and syncs) 4 KiB."""
    import os

    from optimus.checkpoint import preflight

    sizes, fsync = [], os.fsync
    monkeypatch.setattr(preflight.os, "fsync", lambda fd: (sizes.append(os.fstat(fd).st_size), fsync(fd))[1])
    check_run_dir(tmp_path, checkpoint_bytes=1)
    assert sizes == [4096]
