"""What ends an `optimus` command with one line and exit code 2: bad input, and a run that cannot go on."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

EXIT_BAD_INPUT = 2
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE, as a shell tool whose reader went away


def stop_writing_to_a_closed_pipe() -> int:
    """The reader of stdout went away (`optimus plan ... | head`): the interpreter's final flush goes nowhere, so
    the command stops quietly, as a shell tool does; returns the exit code to end with."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_CLOSED_PIPE


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's own errors (a flag's bad value, a missing argument) as the CLI's other bad input: one line and exit
    code 2, naming where the usage is, instead of the usage block before the line. The `optimus` verbs' parsers
    are this class (add_subparsers makes them of the parent's class), and so are the benchmarks' own."""

    def __init__(self, *args, **kwargs):
        # a parser built without a prog is a benchmark script's (the verbs' have theirs from `optimus`)
        self._checks_json_output = kwargs.get("prog") is None and not args
        if self._checks_json_output:
            kwargs["prog"] = _bench_prog()
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = super().parse_known_args(args, namespace)
        if self._checks_json_output and getattr(parsed, "json", None) is not None:
            # checked before the benchmark times anything: a folder or an unwritable place found when it writes
            # would end minutes of timing in a traceback, the figures unwritten
            try:
                output_location("--json", parsed.json)
            except UsageError as err:
                self.error(str(err))
        return parsed, extra

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, usage_error_line(self.prog, message) + "\n")


# Set by `optimus bench NAME` for the script it runs ("file.py:optimus bench NAME"), so that the script's refusals
# name the command the user typed; read only by that very script (anything it starts inherits the variable).
BENCH_PROG_VARIABLE = "OPTIMUS_BENCH_PROG"


def _bench_prog() -> str | None:
    script, _, prog = os.environ.get(BENCH_PROG_VARIABLE, "").partition(":")
    return prog if prog and script == Path(sys.argv[0]).name else None


def usage_error_line(prog: str, message: str) -> str:
    """The one line a refused command line ends with: what `prog` refused, and where its usage is."""
    return f"{prog}: error: {message} (usage: {prog} --help)"


class UsageError(ValueError):
    """A command line or run directory that cannot be used, with the fix in the message."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Every exception that means bad input (its message is the one line to print), imported when needed."""
    from optimus.checkpoint.manager import CheckpointError
    from optimus.config import ConfigError
    from optimus.data.errors import DataError
    from optimus.models.hf import InteropError
    from optimus.parallel.launch import LaunchError
    from optimus.parallel.mesh import LayoutError
    from optimus.resilience.chaos import ChaosError
    from optimus.resilience.guards import NonFiniteHeldOutLoss, TooManySkippedSteps

    return (ConfigError, DataError, CheckpointError, InteropError, LaunchError, LayoutError, TooManySkippedSteps,
            NonFiniteHeldOutLoss, UsageError, ChaosError)


def output_location(flag: str, path: str | Path, *, folder: bool = False) -> Path:
    """Where a command will write the output `flag` names (a file, or with `folder` a directory), checked before any
    work and leaving nothing behind: the nearest existing folder on its way must be one this process can write
    in, or UsageError naming the flag and the fix (a job that plans or exports for minutes should not then fail on
    a mistyped path). The command makes the missing folders when it writes."""
    target = Path(path)
    if target.exists() and target.is_dir() != folder:
        raise UsageError(f"{flag} {path} is a {'file' if folder else 'directory'}: name a "
                         f"{'directory' if folder else 'file'}")
    where = target if folder else target.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise UsageError(f"{flag} {path}: {where} is a file, not a directory: choose another path")
    if not _can_create_in(where):
        raise UsageError(f"{flag} {path}: {where} is not writable: choose a path you can write")
    return target


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be made in `folder`: tried (and removed at once), not asked of os.access, which answers
    yes to root for folders no one can create in (/proc, /sys)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".optimus-write-check-"):
            return True
    except OSError:
        return False
