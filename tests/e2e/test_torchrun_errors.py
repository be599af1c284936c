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


@pytest.mark.parametrize("options, expected", [
    (["--nproc-per-node=0"], "--nproc-per-node 0: must be at least 1"),
    (["--nproc-per-node=-1"], "--nproc-per-node -1: must be at least 1"),
    (["--nproc-per-node=abc"], "torchrun refused its options (Unsupported nproc_per_node value: abc)"),
    (["--nnodes=0", "--nproc-per-node=2"], "--nnodes 0: give a number of nodes of at least 1"),
])
def test_launch_options_torchrun_would_assert_on_are_one_line(options, expected, capsys, tiny_file):
    from optimus.cli import main

    assert main(["launch", *options, "train", str(tiny_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_launch_on_a_port_in_use_is_one_line(tiny_file, tmp_path):
    import socket

    with socket.socket() as held:  # what a stale job or another service would hold
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = _run("-m", "optimus", "launch", "--nproc-per-node=2", f"--master-port={port}", "train",
                      str(tiny_file), "--parallel.dp_shard=2")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"rendezvous at 127.0.0.1:{port} failed" in result.stderr and "another --master-port" in result.stderr
    assert not (tmp_path / "run").exists()


def test_launch_help_prints_torchruns_options():
    result = _run("-m", "optimus", "launch", "--help")
    assert result.returncode == 0 and "--nproc-per-node" in result.stdout, result.stderr
