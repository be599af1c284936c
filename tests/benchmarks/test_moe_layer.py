"""The MoE layer benchmark checks every implementation against the reference and times it, on CPU
at the tiny shape with 64 tokens and one call each; the timings are not checked."""

from __future__ import annotations

import pytest

import json

pytestmark = pytest.mark.slow  # a benchmark's smoke run: make test-slow


def test_moe_layer_benchmark_runs_and_writes_json(tmp_path, load_benchmark, auto_dtype):
    moe_layer = load_benchmark("moe_layer")
    out = tmp_path / "moe_layer.json"
    moe_layer.main(["--device", "cpu", "--shapes", "tiny", "--tokens", "64", "--rounds", "1", "--json", str(out)])
    payload = json.loads(out.read_text())
    dtypes = ["fp32", "bf16"] if auto_dtype == "bf16" else ["fp32"]
    assert payload["dtype_requested"] == "auto"
    assert [p["dtype"] for p in payload["dtypes"]] == dtypes
    for dtype in dtypes:
        rows = {r["impl"]: r for r in payload["results"] if r["dtype"] == dtype}
        assert {"optimus", "reference", "hf-eager"} <= set(rows)  # hf-default may lack a CPU kernel
        for row in rows.values():
            assert row["tokens"] == 64 and row["shape"] == "tiny" and row["dtype_requested"] == "auto"
            assert row["max_rel_error"] <= moe_layer.MATCH_TOLERANCE[moe_layer.DTYPES[dtype]]
            assert row["tokens_per_s"] > 0 and row["pct_of_matmul_peak"] > 0
