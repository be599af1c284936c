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
