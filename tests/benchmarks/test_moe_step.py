"""The whole-step MoE benchmark runs end to end on CPU (one tiny layer, 2 x 64 tokens, one step each)
in the dtype train.dtype=auto picks here, and reports every model against the reference loop; its
figures are not checked (no timing assertions)."""

from __future__ import annotations

import pytest

import json

pytestmark = pytest.mark.slow  # a benchmark's smoke run: make test-slow


def test_moe_step_benchmark_runs_and_writes_json(tmp_path, load_benchmark, auto_dtype):
    moe_step = load_benchmark("moe_step")
    out = tmp_path / "moe_step.json"
    moe_step.main(["--device", "cpu", "--shape", "tiny", "--layers", "1", "--batch", "2", "--seq-len", "64",
                   "--steps", "1", "--rounds", "1", "--no-hf", "--json", str(out)])
    payload = json.loads(out.read_text())
    rows = {row["model"]: row for row in payload["rows"]}
    assert set(rows) == {"optimus", "reference"}
    assert rows["reference"]["vs_reference"] == 1.0
    assert all(row["tokens_per_s"] > 0 and row["tflops"] > 0 for row in rows.values())
    assert (payload["layers"], payload["batch"], payload["seq_len"]) == (1, 2, 64)
    assert (payload["dtype"], payload["dtype_requested"]) == (auto_dtype, "auto")
    assert "native bf16" in payload["dtype_reason"]
