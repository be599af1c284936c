"""The `optimus` command (console script `optimus.cli:main`): main.py parses and dispatches, one module per
group of verbs (train.py, runs.py, info.py, plan.py), errors.py says what counts as bad input."""

from optimus.cli.errors import EXIT_BAD_INPUT, UsageError
from optimus.cli.main import main
from optimus.cli.plan import here_cache_files
from optimus.cli.runs import load_run

__all__ = ["EXIT_BAD_INPUT", "UsageError", "here_cache_files", "load_run", "main"]
