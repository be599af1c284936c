"""Helpers for Optimus's own tests (and for users testing their extensions)."""

from optimus.testing.distributed import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
