"""`optimus launch`'s own parse of torchrun's options: a mistake in them is one line, without torchrun's usage."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.cli import main

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "mula-tiny-moe.yaml")
HELP = ": see optimus launch --help for the options it takes\n"


@pytest.mark.parametrize("options, problem", [
    (["--bogus-opt"], "unknown launch option --bogus-opt"),
    (["--bogus", "--other=1"], "unknown launch options --bogus --other=1"),
    (["--max-restarts=many"], "argument --max-restarts/--max_restarts: invalid int value: 'many'"),
])
def test_a_launch_option_torchrun_does_not_take_is_one_line(options, problem, capsys):
    assert main(["launch", *options, "train", CONFIG]) == 2
    assert capsys.readouterr() == ("", f"optimus launch: error: {problem}{HELP}")


@pytest.mark.parametrize("exitcode, ends_with", [(124, 124), (3, 3), (-9, 1)])
def test_a_worker_that_failed_otherwise_ends_the_launch_with_its_exit_code(exitcode, ends_with, monkeypatch, tmp_path,
                                                                          capsys):
    """Not only bad input keeps its code: a rank the watchdog stopped (124, a hang) ends `optimus launch` with 124,
    so a relaunch loop can tell it from a crash; a worker a signal killed (negative) with 1, as torchrun does."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failing_run(args):
        failure = ProcessFailure(local_rank=1, pid=4242, exitcode=exitcode, error_file=str(tmp_path / "none.json"))
        raise ChildFailedError("optimus", {1: failure})

    monkeypatch.setattr(torch.distributed.run, "run", failing_run)
    assert main(["launch", "--nproc-per-node=2", "train", CONFIG]) == ends_with
    assert "optimus launch: rank 1 failed" in capsys.readouterr().err


def _failure(tmp_path, rank, exitcode, message):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=rank, pid=4200 + rank, exitcode=exitcode,
                             error_file=str(tmp_path / f"none-{rank}.json"))
    failure.message = {"message": message}
    return failure


def test_the_lowest_rank_that_refused_its_input_is_the_line_printed(monkeypatch, tmp_path, capsys):
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    def failing_run(args):
        raise ChildFailedError("optimus", {3: _failure(tmp_path, 3, 2, "optimus train: error: from rank 3"),
                                           1: _failure(tmp_path, 1, 2, "optimus train: error: from rank 1")})

    monkeypatch.setattr(torch.distributed.run, "run", failing_run)
    assert main(["launch", "--nproc-per-node=4", "train", CONFIG]) == 2
    assert capsys.readouterr().err == "optimus train: error: from rank 1\n"


def test_an_exit_code_2_without_an_optimus_line_is_reported_as_a_failed_rank(monkeypatch, tmp_path, capsys):
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    def failing_run(args):
        raise ChildFailedError("optimus", {1: _failure(tmp_path, 1, 2, "usage: something else exited 2")})

    monkeypatch.setattr(torch.distributed.run, "run", failing_run)
    assert main(["launch", "--nproc-per-node=2", "train", CONFIG]) == 2
    assert capsys.readouterr().err.startswith("optimus launch: rank 1 failed\n")


def test_a_rendezvous_failure_names_its_last_line(monkeypatch, capsys):
    import torch.distributed.run
    from torch.distributed import DistNetworkError

    def failing_run(args):
        raise DistNetworkError("The client socket has failed to connect.\n  (details)\nAddress already in use")

    monkeypatch.setattr(torch.distributed.run, "run", failing_run)
    assert main(["launch", "--nproc-per-node=2", "--master-port=29999", "train", CONFIG]) == 2
    err = capsys.readouterr().err
    assert "rendezvous at 127.0.0.1:29999 failed (Address already in use)" in err and len(err.splitlines()) == 1


def test_help_after_the_verb_goes_to_the_verb_and_the_worker_setting_is_not_left_behind(monkeypatch, capsys):
    import os

    import torch.distributed.run

    from optimus.parallel.torchrun import WORKER_ERRORS_ENV

    monkeypatch.delenv(WORKER_ERRORS_ENV, raising=False)
    started = []
    monkeypatch.setattr(torch.distributed.run, "run",
                        lambda args: started.append((args.training_script_args, os.environ.get(WORKER_ERRORS_ENV))))
    assert main(["launch", "--nproc-per-node=2", "train", CONFIG, "--help"]) == 0
    assert started == [(["train", CONFIG, "--help"], "launcher")]
    assert "torchrun's options" not in capsys.readouterr().out
    assert WORKER_ERRORS_ENV not in os.environ
