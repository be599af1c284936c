"""A run killed with SIGKILL at any moment, or stopped by SIGTERM, and started again gives exactly the losses
of a run never stopped."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import run_cli, start_cli, tiny_config

pytestmark = pytest.mark.slow


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    text = path.read_text()
    # whole lines only: the run may be writing the last one as it is read (a torn line can end in a nested "}")
    steps = [json.loads(line)["step"] for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, token_dir) -> dict[int, float]:
    """The losses of the tiny config's run never stopped (the config_file fixture's settings)."""
    reference = tmp_path_factory.mktemp("reference")
    (reference / "tiny.yaml").write_text(yaml.safe_dump(tiny_config(token_dir)))
    result = run_cli("train", str(reference / "tiny.yaml"), f"--run.dir={reference / 'run'}", "--no-progress")
    assert result.returncode == 0, result.stderr
    return losses(reference / "run")


def kill_when(run_dir: Path, args: list[str], condition, deadline_s: float = 120) -> None:
    proc = start_cli(*args)
    deadline = time.monotonic() + deadline_s
    while not condition() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, f"run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_sigkill_anywhere_then_rerun_gives_identical_losses(tmp_path, config_file, reference_losses):
    expected = reference_losses
    assert sorted(expected) == list(range(1, 9))

    run = tmp_path / "killed"
    # loss.png on (tiny_config switches it off): redrawn across the kills, it must end whole
    args = ["train", str(config_file), f"--run.dir={run}", "--no-progress", "--train.loss_plot=true"]
    # 1) mid-step, after a checkpoint: steps 3+ are recomputed from step 2
    kill_when(run, args, lambda: last_step(run) >= 3)
    # 2) during a checkpoint write: the half-written one must be ignored
    kill_when(run, args, lambda: any(p.name.startswith(".tmp-step") for p in (run / "checkpoints").glob(".tmp-*")))
    # 3) right after start-up, before any new step
    kill_when(run, args, lambda: (run / "config.yaml").exists() and last_step(run) >= 4)
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert losses(run) == expected  # bit-for-bit: fp32 on CPU is deterministic
    committed = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "COMMITTED").exists())
    assert committed == ["step-6", "step-8"]  # keep_last_k = 2
    assert (run / "latest").read_text().strip() == "8"
    assert (run / "loss.png").stat().st_size > 1000


def test_sigkill_while_an_async_checkpoint_is_pending_then_rerun_gives_identical_losses(
        tmp_path, config_file, reference_losses):
    """With train.async_checkpoint the same run is killed while step 6's checkpoint is still being
    written and step 7 already trained: the rerun resumes from the committed step 4."""
    run = tmp_path / "killed"
    args = ["train", str(config_file), f"--run.dir={run}", "--no-progress", "--train.async_checkpoint=true"]
    kill_when(run, args, lambda: (run / "checkpoints" / ".tmp-step-6").exists() and last_step(run) >= 7)
    assert (run / "checkpoints" / "step-4" / "COMMITTED").exists()  # committed while step 6 trained
    assert not list((run / "checkpoints").glob(".tmp-*/COMMITTED"))
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert losses(run) == reference_losses
    committed = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "COMMITTED").exists())
    assert committed == ["step-6", "step-8"] and not list((run / "checkpoints").glob(".tmp-*"))
    assert (run / "latest").read_text().strip() == "8"


def test_rerun_of_a_finished_run_changes_nothing(tmp_path, config_file):
    run = tmp_path / "done"
    first = run_cli("train", str(config_file), f"--run.dir={run}", "--no-progress", "--train.max_steps=2")
    assert first.returncode == 0, first.stderr
    before = losses(run)
    again = run_cli("train", str(config_file), f"--run.dir={run}", "--no-progress", "--train.max_steps=2")
    assert again.returncode == 0, again.stderr
    assert losses(run) == before


def test_sigterm_checkpoints_the_step_it_stops_at_exits_0_and_rerun_gives_identical_losses(
        tmp_path, config_file, reference_losses):
    """Preemption (Slurm, torchrun and PBS send SIGTERM): the run commits a checkpoint at the next step boundary,
    says so and exits with 0; the same command resumes from exactly there."""
    run = tmp_path / "preempted"
    args = ["train", str(config_file), f"--run.dir={run}", "--no-progress"]
    proc = start_cli(*args)
    deadline = time.monotonic() + 120
    while last_step(run) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, f"run ended before the signal: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 0, stderr
    match = re.search(r"SIGTERM at step (\d+): checkpoint saved, exiting; rerun the same command to resume", stderr)
    assert match, stderr
    stopped_at = int(match.group(1))
    assert 1 <= stopped_at < 8 and last_step(run) == stopped_at
    assert (run / "checkpoints" / f"step-{stopped_at}" / "COMMITTED").exists()
    assert (run / "latest").read_text().strip() == str(stopped_at)
    assert "Traceback" not in stderr and "sample:" not in stderr

    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert losses(run) == reference_losses
