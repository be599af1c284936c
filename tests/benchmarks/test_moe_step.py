"""The whole-step MoE benchmark runs end to end on CPU (one tiny layer, one step each) and reports
every model against the reference loop; its figures are not checked (no timing assertions)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_moe_step_benchmark_runs_and_writes_json(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    moe_step = importlib.import_module("moe_step")
    out = tmp_path / "moe_step.json"
    moe_step.main(["--device", "cpu", "--shape", "tiny", "--layers", "1", "--steps", "1", "--rounds", "1",
                   "--no-hf", "--json", str(out)])
    payload = json.loads(out.read_text())
    rows = {row["model"]: row for row in payload["rows"]}
    assert set(rows) == {"optimus", "reference"}
    assert rows["reference"]["vs_reference"] == 1.0
    assert all(row["tokens_per_s"] > 0 and row["tflops"] > 0 for row in rows.values())
    assert payload["layers"] == 1 and payload["dtype"] == "bf16"
    sys.modules.pop("moe_step", None)
