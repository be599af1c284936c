"""The Slurm and PBS job scripts' recovery: relaunch after a crash, requeue/resubmit after a preemption.

Each script runs under bash here with stub scheduler commands first on PATH. The srun/mpiexec stubs
record their arguments, set the variables Slurm or PALS give a task (one task: rank 0 of 1) and run
the training command as one local process, optionally killing it (SIGKILL: a crash) or preempting it
(SIGUSR1: checkpoint and exit 0) once its first checkpoint is committed. scontrol/qstat/qsub/module
stubs record what the script asked of the scheduler.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optimus.parallel.launch import detect_launch_env
from tests.e2e.conftest import REPO, cli_env, tiny_config

LAUNCH = REPO / "examples" / "launch"
SLURM, PBS = LAUNCH / "slurm-frontier.sh", LAUNCH / "pbs-aurora.sh"
MAX_STEPS = 8

# Runs the command after the launcher's options as ONE local task with the scheduler's variables.
# STUB_FAULT=crash|preempt: once (a marker file), signal the task when the run's first checkpoint exists.
LAUNCHER_STUB = r"""#!/usr/bin/env bash
echo "$(basename "$0") $*" >>"$STUB_LOG"
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in -N|-n|--ppn|--cpu-bind) shift 2 ;; *) shift ;; esac
done
export OMP_NUM_THREADS=1  # the scripts' per-rank thread count is for a compute node, not this test machine
{TASK_ENV}
[[ $* == *optimus* ]] && env >"$STUB_DIR/task-env"
if [[ -z ${STUB_FAULT:-} || -e $STUB_DIR/fault-done || $* != *optimus* ]]; then exec "$@"; fi
touch "$STUB_DIR/fault-done"
"$@" &
pid=$!
while [[ ! -e $STUB_RUN_DIR/latest ]] && kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
signal=KILL; [[ $STUB_FAULT == preempt ]] && signal=USR1
if kill -s "$signal" "$pid" 2>/dev/null; then echo "fault: SIG$signal"; else echo "fault: too late"; fi >>"$STUB_LOG"
wait "$pid"
"""
SLURM_TASK_ENV = ("export SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0 SLURM_NTASKS_PER_NODE=1 "
                  "SLURM_STEP_NODELIST=localhost")
PALS_TASK_ENV = "export PALS_RANKID=0 PMI_SIZE=1 PALS_LOCAL_RANKID=0 PALS_LOCAL_SIZE=1"

RECORDER_STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >>"$STUB_LOG"
{BODY}
exit 0
"""
STUBS = {
    "module": "",
    "scontrol": '[[ $1 == show ]] && echo localhost',
    "qsub": "echo 78.aurora-pbs",
    "qstat": 'printf "Job Id: %s\\n    Account_Name = proj42\\n    Resource_List.walltime = 02:00:00\\n" "$PBS_JOBID"',
}


def _write_stubs(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(RECORDER_STUB.replace("{BODY}", body))
    (bin_dir / "srun").write_text(LAUNCHER_STUB.replace("{TASK_ENV}", SLURM_TASK_ENV))
    (bin_dir / "mpiexec").write_text(LAUNCHER_STUB.replace("{TASK_ENV}", PALS_TASK_ENV))
    # The scripts call `python`: this interpreter (a wrapper, not a symlink: a venv is found from its path).
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)


@pytest.fixture
def job(tmp_path, token_dir):
    """A submit directory with stubs, a tiny config and the run dir the overrides point at."""
    _write_stubs(tmp_path / "bin")
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config(
        token_dir, train={"max_steps": MAX_STEPS, "ckpt_every": 2, "eval_every": 0, "keep_last_k": 2})))
    return tmp_path


def _run(script: Path, job: Path, overrides: list[str], fault: str = "", **extra: str):
    env = dict(cli_env(), PATH=f"{job / 'bin'}:{os.environ['PATH']}", STUB_LOG=str(job / "calls.log"),
               STUB_DIR=str(job), STUB_RUN_DIR=str(job / "run"), STUB_FAULT=fault, USER="tester",
               LAUNCH_DIR=str(LAUNCH), MAX_RELAUNCHES="2", **extra)
    if script == SLURM:
        env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="optimus", SLURM_JOB_NODELIST="localhost",
                   SLURM_JOB_NUM_NODES="1")
        argv = ["bash", str(script), str(job / "tiny.yaml"), *overrides]
        log = job / "logs" / "optimus-4242.out"
    else:
        (job / "nodefile").write_text("localhost\n")
        env.update(PBS_JOBID="77.aurora-pbs", PBS_NODEFILE=str(job / "nodefile"), PBS_O_WORKDIR=str(job),
                   PBS_QUEUE="prod", CONFIG=str(job / "tiny.yaml"), ARGS=" ".join(overrides))
        argv = ["bash", str(script)]
        log = None
    result = subprocess.run(argv, cwd=job, env=env, capture_output=True, text=True, timeout=300)
    output = log.read_text() if log else result.stdout + result.stderr
    calls = (job / "calls.log").read_text().splitlines()
    return result.returncode, output, calls


def _latest(job: Path) -> int:
    return int((job / "run" / "latest").read_text())


def _task_launcher(job: Path):
    """What optimus.parallel.launch makes of the environment the last training task ran in."""
    lines = (job / "task-env").read_text().splitlines()
    return detect_launch_env(dict(line.split("=", 1) for line in lines if "=" in line))


def test_scripts_parse():
    for script in (SLURM, PBS):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_slurm_crash_is_relaunched_on_the_same_nodes_and_finishes(job):
    code, log, calls = _run(SLURM, job, [f"--run.dir={job / 'run'}"], fault="crash")
    assert code == 0, log
    assert "fault: SIGKILL" in calls
    assert [call for call in calls if call.startswith("srun") and "optimus" in call] == \
        [f"srun -N 1 --ntasks-per-node=8 --cpus-per-task=7 --cpu-bind=cores python -m optimus train "
         f"{job / 'tiny.yaml'} --run.dir={job / 'run'}"] * 2
    assert "attempt 1 exited with 137" in log and "relaunching on the same nodes" in log
    assert "attempt 2 exited with 0" in log and f"at step {MAX_STEPS} of {MAX_STEPS}" in log
    assert not any(call.startswith("scontrol requeue") for call in calls)
    assert _latest(job) == MAX_STEPS
    launch = _task_launcher(job)
    assert (launch.launcher, launch.rank, launch.world_size, launch.master_addr) == ("slurm", 0, 1, "localhost")


def test_slurm_preemption_requeues_the_job(job):
    code, log, calls = _run(SLURM, job, [f"--run.dir={job / 'run'}"], fault="preempt")
    assert code == 0, log
    assert "fault: SIGUSR1" in calls
    assert "scontrol requeue 4242" in calls
    assert "attempt 2" not in log  # exit 0 is not a crash
    assert 2 <= _latest(job) < MAX_STEPS


@pytest.mark.slow  # extra coverage; make test keeps one relaunch, one requeue, one resubmit
def test_slurm_bad_input_is_neither_relaunched_nor_requeued(job):
    code, log, calls = _run(SLURM, job, ["--train.max_stepz=3"])
    assert code == 2
    assert "max_stepz" in log and "not relaunching" in log
    assert sum(call.startswith("srun") and "optimus" in call for call in calls) == 1
    assert not any(call.startswith(("scontrol requeue", "qsub")) for call in calls)


@pytest.mark.slow  # extra coverage; make test keeps one relaunch, one requeue, one resubmit
def test_pbs_normal_finish_neither_relaunches_nor_resubmits(job):
    code, out, calls = _run(PBS, job, [f"--run.dir={job / 'run'}"])
    assert code == 0, out
    assert sum(call.startswith("mpiexec") for call in calls) == 1
    assert not any(call.startswith("qsub") for call in calls)
    assert _latest(job) == MAX_STEPS
    launch = _task_launcher(job)
    assert (launch.launcher, launch.rank, launch.world_size, launch.master_addr) == ("pals", 0, 1, "localhost")


def test_pbs_preemption_resubmits_with_the_same_variables(job):
    code, out, calls = _run(PBS, job, [f"--run.dir={job / 'run'}"], fault="preempt")
    assert code == 0, out
    assert "fault: SIGUSR1" in calls
    assert 2 <= _latest(job) < MAX_STEPS
    assert f"qsub -l select=1 -l walltime=02:00:00 -A proj42 -q prod -v CONFIG={job / 'tiny.yaml'},ARGS=" \
           f"--run.dir={job / 'run'},RESUBMITS=1,MAX_RESUBMITS=20,MAX_RELAUNCHES=2,LAUNCH_DIR={LAUNCH} " \
           f"{LAUNCH / 'pbs-aurora.sh'}" in calls
