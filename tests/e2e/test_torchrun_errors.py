"""Bad input under torchrun: rank 0's one line, the other ranks quiet; `optimus launch` prints it last, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.e2e.conftest import cli_env, tiny_config

pytestmark = pytest.mark.distributed

# two ranks asked to run a four-rank layout: only the trainer, which knows the world size, can refuse it
BAD_LAYOUT = "--parallel.dp_shard=4"
LINE = ("optimus train: error: parallel.dp_replicate x dp_shard x tp x pp = 1 x 4 x 1 x 1 = 4, but the job has 2 "
        "ranks: make the product equal the world size")


@pytest.fixture
def tiny_file(tmp_path, token_dir):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(token_dir, run={"dir": str(tmp_path / "run")}, train={"micro_batch_size": None})))
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(cli_env(), GLOO_SOCKET_IFNAME="lo")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, env=env)


def test_optimus_launch_ends_with_the_one_line_and_exit_code_2(tiny_file, tmp_path):
    result = _run("-m", "optimus", "launch", "--nproc-per-node=2", "train", str(tiny_file), BAD_LAYOUT)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == LINE, result.stderr
    assert result.stderr.count("optimus train: error:") == 1  # the workers left it to the launcher
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_plain_torchrun_shows_the_line_once_and_names_it_as_the_root_cause(tiny_file):
    result = _run("-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "optimus", "train", str(tiny_file),
                  BAD_LAYOUT)
    assert result.returncode != 0
    printed = [line for line in result.stderr.splitlines() if line.startswith("optimus train: error:")]
    assert printed == [LINE], result.stderr  # rank 0 said it once, rank 1 stayed quiet
    root_cause = result.stderr.split("Root Cause")[1]
    assert "rank      : 0" in root_cause and f"traceback : {LINE}" in root_cause, result.stderr
