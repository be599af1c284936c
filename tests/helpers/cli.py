"""`optimus ARGS` in the test's own process: for what exits before any real work (flag checks, refusals, a plan),
where a fresh interpreter's start (torch's import) would be seconds on a 2-core CPU."""

from __future__ import annotations


def run_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `optimus ARGS`, run by optimus.cli.main here; `capsys` is pytest's fixture."""
    from optimus.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err
