"""Fixtures for the benchmark smoke tests: the scripts imported as modules, and the dtype "auto"
resolves to on this machine (so that no test depends on which kind of CPU runs it)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.helpers.precision import cpu_auto_dtype

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def load_benchmark(monkeypatch):
    """Import a benchmark script by name (e.g. "train_step"); the imports are dropped afterwards."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.syspath_prepend(str(BENCHMARKS.parent))
    before = set(sys.modules)
    yield importlib.import_module
    for name in set(sys.modules) - before:
        if name in ("_common", "train_step", "moe_step", "moe_layer", "scaling", "optimizer", "plan_vs_measured", "host_memory",
                    "checkpointing", "expert_shapes", "metrics_log", "ep_dispatch") or name.startswith("benchmarks"):
            sys.modules.pop(name, None)


@pytest.fixture
def auto_dtype() -> str:
    """What train.dtype=auto trains in on this CPU: bf16 only where it is native."""
    return cpu_auto_dtype()
