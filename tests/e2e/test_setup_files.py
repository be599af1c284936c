"""The files a newcomer meets before any Python: Makefile set-up, job scripts, the shipped configs."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _make_n(*targets: str, tmp_path: Path) -> str:
    """The commands `make TARGETS` would run (nothing is run), with a venv path that does not exist."""
    venv = tmp_path / "venv"
    result = subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"STAMP={venv}/.installed", *targets], cwd=REPO,
                            capture_output=True, text=True, check=True)
    return result.stdout


@needs_make
def test_make_setup_is_quiet_with_one_line_per_stage(tmp_path):
    commands = _make_n("setup", tmp_path=tmp_path).splitlines()
    installs = [c for c in commands if "pip install" in c]
    assert len(installs) >= 4
    for command in installs:
        assert " -qq " in command and "--disable-pip-version-check" in command, command
    stages = [c for c in commands if c.startswith('echo "setup: ')]
    assert any("installing torch" in s for s in stages) and len(stages) >= len(installs)
    # the recipe's commands themselves are not echoed: only the stage lines are printed
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("$(STAMP): pyproject.toml Makefile\n", 1)[1].split("\n\n", 1)[0]
    assert all(line.startswith("\t@") for line in recipe.splitlines()), recipe
    assert re.search(r"PIP_NO_WARN_SCRIPT_LOCATION", makefile)


@needs_make
def test_make_test_slow_runs_the_slow_tests(tmp_path):
    commands = _make_n("test-slow", tmp_path=tmp_path)
    assert re.search(r'pytest .*-m "slow or soak"', commands), commands


def test_slurm_script_creates_its_log_folder(tmp_path):
    """Slurm opens the -o file before the script runs: it must not point into a folder nobody made, and the
    script writes the job's log under logs/, which it creates."""
    script = REPO / "examples" / "launch" / "slurm-frontier.sh"
    output = re.search(r"^#SBATCH -o (\S+)", script.read_text(), re.M).group(1)
    assert "/" not in output, output
    stubs = tmp_path / "bin"
    stubs.mkdir()
    # python: the script's "is the run finished?" check after training (tested in test_launch_scripts.py)
    for name, body in {"srun": 'echo "srun $*"', "scontrol": "echo node0", "module": "true",
                       "python": 'echo "finished: $*"'}.items():
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(stat.S_IRWXU)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", SLURM_JOB_NAME="optimus", SLURM_JOB_ID="42",
               SLURM_JOB_NODELIST="node0", SLURM_JOB_NUM_NODES="1", USER="someone")
    work = tmp_path / "submit"
    work.mkdir()
    result = subprocess.run(["bash", "-c", f'module() {{ true; }}; export -f module; bash {script} CONFIG --x.y=1'],
                            cwd=work, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    log = (work / "logs" / "optimus-42.out").read_text()
    assert "python -m optimus train CONFIG --x.y=1" in log


def test_only_the_default_job_calls_itself_default():
    default = re.search(r"^train: .*\n\t.*optimus train (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    for config in sorted((REPO / "configs").glob("*.yaml")):
        first_line = config.read_text().splitlines()[0]
        says_default = first_line.startswith("# The default job")
        assert says_default == (config.relative_to(REPO).as_posix() == default), (config.name, first_line)
