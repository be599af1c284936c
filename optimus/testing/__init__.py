"""Helpers for Optimus's own tests (and for users testing their extensions)."""

from optimus.testing.distributed import DistributedTestError, in_forked_process, run_distributed, run_forked

__all__ = ["DistributedTestError", "in_forked_process", "run_distributed", "run_forked"]
