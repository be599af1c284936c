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
