"""The rounded-vs-exact expert GEMM benchmark runs end to end on a few tokens, times each variant with the
rounding it names, and leaves the rounding as training runs it; its figures are not checked (no timing
assertions)."""

from __future__ import annotations

import json

import torch

from optimus.ops import cpu_experts


def test_expert_shapes_benchmark_times_both_variants(tmp_path, load_benchmark, monkeypatch):
    script = load_benchmark("expert_shapes")
    seen = []
    real_call = script.layer_call

    def recording_call(inputs):
        seen.append(cpu_experts._KERNEL_PER_SHAPE)
        real_call(inputs)

    monkeypatch.setattr(script, "layer_call", recording_call)
    out = tmp_path / "expert_shapes.json"
    assert script.main(["--dtype", "bf16", "--tokens", "48", "--calls", "1", "--rounds", "2", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [row["regime"] for row in payload["results"]] == ["fresh routing", "same routing"]
    assert payload["rows_rounded"] and payload["dtype"] == "bf16"
    assert all(row["calls"] == 2 and row["rounded_median_s"] > 0 and row["exact_median_s"] > 0
               for row in payload["results"])
    assert set(seen) == {(torch.bfloat16, torch.float16), ()}  # each variant ran with its own rounding
    assert cpu_experts._KERNEL_PER_SHAPE == (torch.bfloat16, torch.float16)  # restored for training
