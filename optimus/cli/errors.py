"""What ends an `optimus` command with one line and exit code 2: bad input, and a run that cannot go on."""

from __future__ import annotations

EXIT_BAD_INPUT = 2


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
    from optimus.resilience.guards import TooManySkippedSteps

    return (ConfigError, DataError, CheckpointError, InteropError, LaunchError, LayoutError, TooManySkippedSteps,
            UsageError, ChaosError)
