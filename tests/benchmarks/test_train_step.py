"""The training-step benchmark (ours vs HF OLMoE, dense MFU) runs end to end on CPU at a tiny size
(one layer, 1 x 32 tokens, one step per round) and writes every figure for each dtype native here;
the figures are not checked (no timing assertions)."""

from __future__ import annotations

import pytest

import json

pytestmark = pytest.mark.slow  # a benchmark's smoke run: make test-slow


def test_train_step_benchmark_runs_and_writes_json(tmp_path, load_benchmark, auto_dtype):
    train_step = load_benchmark("train_step")
    out = tmp_path / "train_step.json"
    train_step.main(["--batch", "1", "--seq-len", "32", "--layers", "1", "--steps", "1", "--rounds", "1",
                     "--json", str(out)])
    payload = json.loads(out.read_text())
    assert (payload["batch"], payload["seq_len"], payload["layers"]) == (1, 32, 1)
    assert payload["dtype_requested"] == "auto"
    # auto compares fp32 everywhere and bf16 only where this CPU computes it natively
    assert list(payload["figures"]) == (["fp32", "bf16"] if auto_dtype == "bf16" else ["fp32"])
    for dtype, figures in payload["figures"].items():
        assert figures["dtype"] == dtype and figures["dtype_requested"] == "auto" and figures["dtype_reason"]
        for key in ("ours_tokens_per_s", "hf_tokens_per_s", "ratio", "dense_tokens_per_s", "matmul_peak_gflops",
                    "dense_mfu"):
            assert figures[key] > 0, key
        assert figures["matmul_peak"] == f"{dtype} matmul"
