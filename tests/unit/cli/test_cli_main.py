"""The entry point's checks before any verb runs: OMP_NUM_THREADS, and the flags argparse refuses."""

from __future__ import annotations

import errno
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optimus.cli import main
from optimus.cli.main import check_omp_num_threads

REPO = Path(__file__).resolve().parents[3]
CONFIG = str(REPO / "configs" / "mula-tiny-moe.yaml")


def _line(verb: str, value: str) -> str:
    return (f"optimus {verb}: error: OMP_NUM_THREADS={value!r} is not a positive number of threads: unset it, or set "
            "it to a positive integer (the threads each process uses, e.g. OMP_NUM_THREADS=4)\n")


@pytest.mark.parametrize("argv, line", [
    (["plan", CONFIG, "--cluster", "h100", "--devices", "8", "--tokens", "abc"],
     "optimus plan: error: argument --tokens: 'abc' is not a number of tokens: give e.g. 100e9 or 100B (suffixes "
     "K, M, B, T) (usage: optimus plan --help)"),
    (["plan", CONFIG, "--cluster", "h100", "--devices", "8", "--tokens", "B"],
     "optimus plan: error: argument --tokens: 'B' is not a number of tokens: give e.g. 100e9 or 100B (suffixes "
     "K, M, B, T) (usage: optimus plan --help)"),
    (["plan", "--cluster", "h100"],
     "optimus plan: error: the following arguments are required: config, --devices (usage: optimus plan --help)"),
    (["tune", CONFIG, "--trials", "x"], "optimus tune: error: argument --trials: invalid int value: 'x' (usage: "
                                        "optimus tune --help)"),
    ([], "optimus: error: the following arguments are required: verb (usage: optimus --help)"),
])
def test_a_flag_argparse_refuses_is_one_line_and_exit_2(argv, line, capsys):
    """Not argparse's usage block before the line: the line names the flag and where its usage is."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2 and capsys.readouterr() == ("", line + "\n")


def test_a_flag_a_verb_does_not_take_is_one_line_naming_the_verb(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--bogus"]) == 2
    assert capsys.readouterr() == ("", "optimus report: error: unrecognized arguments: --bogus (usage: optimus report "
                                       "--help)\n")


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "4,0"])
def test_a_bad_omp_num_threads_is_one_line_before_anything_runs(value, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert main(["train", CONFIG, "--dry-run"]) == 2  # --dry-run would print the config and exit 0
    assert capsys.readouterr() == ("", _line("train", value))


def test_launch_refuses_a_bad_omp_num_threads_before_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "abc")
    assert main(["launch", "--nproc-per-node=2", "train", CONFIG]) == 2
    assert capsys.readouterr() == ("", _line("launch", "abc"))


@pytest.mark.parametrize("value", ["4", " 2 ", "4,2"])
def test_a_positive_omp_num_threads_is_kept(value):
    env = {"OMP_NUM_THREADS": value}
    check_omp_num_threads(env)
    assert env == {"OMP_NUM_THREADS": value}


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_omp_num_threads_is_unset(value):
    env = {"OMP_NUM_THREADS": value}
    check_omp_num_threads(env)
    assert env == {}  # libgomp then stays quiet, and torchrun gives several ranks a thread each


def test_libgomp_does_not_add_its_own_warning():
    env = dict(os.environ, OMP_NUM_THREADS="abc", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "optimus", "train", CONFIG, "--train.max_steps=1"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert (result.returncode, result.stderr) == (2, _line("train", "abc")), result.stderr


def test_a_path_the_system_refuses_is_one_line(monkeypatch, capsys):
    # as root os.access passes a /proc path, so the write itself fails: FileNotFoundError, once a traceback
    cli_main = importlib.import_module("optimus.cli.main")  # the package exports a function of the same name

    def writes_under_proc(args, overrides):
        open("/proc/optimus-plan.json", "w")

    monkeypatch.setattr(cli_main, "cmd_info", writes_under_proc)  # main() builds its parser from the module's names
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "on /proc/optimus-plan.json: check that path" in err


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_or_quota_is_one_line_even_when_the_error_names_no_path(code, monkeypatch, capsys):
    """A flush or close that hits a full disk raises OSError(ENOSPC) without a filename: `optimus report`, `export`,
    `tokenize` and `plan --json` ended in a traceback on a full tmpfs. EDQUOT (a user's quota on a shared
    filesystem) is the disk being full for this user: the same one line."""
    cli_main = importlib.import_module("optimus.cli.main")

    def fills_the_disk(args, overrides):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(cli_main, "cmd_info", fills_the_disk)
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{os.strerror(code)} where it writes: free space there" in err


def test_an_os_error_without_a_path_keeps_its_traceback(monkeypatch):
    cli_main = importlib.import_module("optimus.cli.main")  # the package exports a function of the same name

    def fails(args, overrides):
        raise ConnectionResetError("peer went away")

    monkeypatch.setattr(cli_main, "cmd_info", fails)
    with pytest.raises(ConnectionResetError):
        main(["info"])


def test_a_reader_that_goes_away_stops_the_command_quietly():
    """`optimus plan ... | head`: the pipe closes after a few lines; no traceback, SIGPIPE's exit status."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # 1,000 rows (~150 KB) outgrow the pipe's buffer, so the command is still writing when head has gone
    command = (f"{sys.executable} -m optimus plan {CONFIG} --cluster h100 --devices 8 --top 1000 | head -1; "
               "exit ${PIPESTATUS[0]}")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert result.returncode == 141 and result.stdout.count("\n") == 1
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


@pytest.mark.parametrize("verb", ["plan", "tune", "report"])
def test_launch_names_a_verb_that_runs_on_its_own(verb, capsys):
    assert main(["launch", "--nproc-per-node=2", verb, CONFIG]) == 2
    assert capsys.readouterr().err == (f"optimus launch: error: `optimus {verb}` is not started through launch: run "
                                       f"`optimus {verb} ...` on its own (launch starts the ranks of eval, export, "
                                       "generate, import, info, tokenize, train)\n")


def test_launch_without_a_verb_lists_the_launchable_ones(capsys):
    assert main(["launch", "--nproc-per-node=2", "frobnicate"]) == 2
    assert capsys.readouterr().err.startswith("optimus launch: error: no optimus command after the torchrun options")


def test_a_quiet_rank_waits_twice_its_start_up_until_the_ranks_have_met(monkeypatch):
    """A non-zero rank that meets bad input waits before it records it, so that rank 0 says it first: 3 s once the
    ranks run in step (a process group); before that, twice as long as this process has run (a busy host's start-ups
    differed by 5 s: rank 1's record, written 3 s after its error, became torchrun's root cause), at most 60."""
    import time
    from types import SimpleNamespace

    cli_main = importlib.import_module("optimus.cli.main")  # the package exports a function of the same name
    not_met = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "torch.distributed", not_met)
    for ran_s, least in ((0.5, 3.0), (7.5, 15.0)):
        monkeypatch.setattr(cli_main, "_STARTED", time.monotonic() - ran_s)
        delay = cli_main._quiet_rank_delay()
        assert least <= delay <= max(3.0, 2 * (time.monotonic() - cli_main._STARTED))  # (the clock runs meanwhile)
    monkeypatch.setattr(cli_main, "_STARTED", time.monotonic() - 100.0)
    assert cli_main._quiet_rank_delay() == 60.0
    monkeypatch.setitem(sys.modules, "torch.distributed", SimpleNamespace(is_available=lambda: True,
                                                                          is_initialized=lambda: True))
    assert cli_main._quiet_rank_delay() == 3.0


def test_a_chaos_harness_that_cannot_run_is_one_line(monkeypatch, capsys):
    """ChaosError (too few steps for the faults asked, a stage that timed out) is bad input like the others: one
    line and exit code 2, not a RuntimeError's traceback."""
    from optimus.resilience.chaos import ChaosError

    cli_main = importlib.import_module("optimus.cli.main")

    def cannot_run(args, overrides):
        raise ChaosError("10 faults need at least 24 training steps: raise --train.max_steps")

    monkeypatch.setattr(cli_main, "cmd_info", cannot_run)
    assert main(["info"]) == 2
    assert capsys.readouterr().err == ("optimus info: error: 10 faults need at least 24 training steps: raise "
                                       "--train.max_steps\n")


def test_an_interrupted_command_says_so_and_exits_130(monkeypatch, capsys):
    """Ctrl-C: one line naming the verb and the shell's code for SIGINT (128 + 2), not a traceback."""
    cli_main = importlib.import_module("optimus.cli.main")

    def interrupted(args, overrides):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "cmd_info", interrupted)
    assert main(["info"]) == 130
    assert capsys.readouterr().err == "optimus info: interrupted\n"


def test_only_rank_0_prints_the_error_line_and_every_rank_records_it(monkeypatch, capsys, tmp_path):
    """Every rank usually meets the same bad input: the line is printed once (rank 0), while each rank's torchrun
    error file records it."""
    import json
    from types import SimpleNamespace

    cli_main = importlib.import_module("optimus.cli.main")
    monkeypatch.setattr(cli_main, "_quiet_rank_delay", lambda: 0.0)
    monkeypatch.delenv("OPTIMUS_WORKER_ERRORS", raising=False)
    for rank in (1, 0):
        monkeypatch.setattr("optimus.parallel.launch.detect_launch_env", lambda rank=rank: SimpleNamespace(rank=rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error-{rank}.json"))
        cli_main._report_user_error(f"optimus train: error: bad on rank {rank}")
        assert json.loads((tmp_path / f"error-{rank}.json").read_text())["message"]["message"].endswith(f"rank {rank}")
    assert capsys.readouterr().err == "optimus train: error: bad on rank 0\n"


def test_info_counts_in_the_largest_unit_a_count_reaches():
    """1,000,000,000 parameters is 1.00B, not 1000.00M; one under a unit stays in the unit below."""
    from optimus.cli.info import _human

    assert [_human(n) for n in (10**9, 10**9 - 10**6, 10**6, 999, 1000)] == ["1.00B", "999.00M", "1.00M", "999",
                                                                             "1.00K"]


@pytest.mark.parametrize("seq_len", ["0", "-1"])
def test_info_at_no_sequence_length_is_one_line(seq_len, capsys):
    assert main(["info", "--seq-len", seq_len]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"optimus info: error: --seq-len must be at least 1 (got {seq_len})"]


def test_info_names_a_yaml_path_that_is_not_there_as_a_missing_file_not_a_preset(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["info", "mine.yaml"]) == 2
    assert "error: config file 'mine.yaml' not found: give the path of a YAML config" in capsys.readouterr().err
