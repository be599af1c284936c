"""Helpers for Optimus's own tests, not shipped with the package: gloo multi-process runs, parity against one
process, tiny runs, op inputs. Imported as `tests.helpers` (pytest puts the repository root on sys.path:
see `pythonpath` in pyproject.toml; benchmarks add it themselves)."""

from tests.helpers.distributed import DistributedTestError, in_forked_process, run_distributed, run_forked

__all__ = ["DistributedTestError", "in_forked_process", "run_distributed", "run_forked"]
