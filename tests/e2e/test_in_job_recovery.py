"""In-job recovery: under `torchrun --max-restarts=1`, SIGKILL of one worker rank is survived by the job.

The surviving rank fails on its next collective, torchrun restarts the worker group, the new attempt joins
under its own store prefix (a restarted gloo group can otherwise read the dead attempt's addresses) and
resumes from the last checkpoint; the steps it computes again give exactly the losses they gave before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import REPO, cli_env, tiny_config

pytestmark = pytest.mark.soak


def _worker_pid(local_rank: int, marker: str) -> int | None:
    """The torchrun worker with LOCAL_RANK=local_rank whose command line contains `marker`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in command and "torch.distributed.run" not in command and f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(entry.name)
    return None


def _losses(path: Path) -> dict[int, float]:
    text = path.read_text()
    # whole lines only: the job may be writing the last one as it is read
    rows = [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def test_sigkill_of_one_rank_is_survived_with_exact_losses(tmp_path, token_dir):
    run = tmp_path / "run"
    config = tiny_config(token_dir, train=dict(max_steps=16, ckpt_every=4, eval_every=0, global_batch_size=8),
                         parallel=dict(dp_shard=2), run=dict(dir=str(run)))
    path = tmp_path / "recover.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=1", "-m", "optimus", "train", str(path), "--no-progress"]
    job = subprocess.Popen(command, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not metrics.exists() or len(_losses(metrics)) < 6):
        time.sleep(0.1)
    before = _losses(metrics)
    victim = _worker_pid(1, str(path))
    assert victim is not None and len(before) >= 6
    os.kill(victim, signal.SIGKILL)
    output, _ = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert job.returncode == 0, output[-3000:]
    assert "exitcode: -9" in output  # torchrun saw the kill and restarted the group
    after = _losses(metrics)
    assert sorted(after) == list(range(1, 17))
    # steps after the last checkpoint before the kill were computed twice, by two attempts: identical losses
    assert all(after[step] == before[step] for step in before), (before, after)
