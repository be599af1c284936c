"""The optimizer benchmark runs end to end on 4 gloo ranks (dp 2 x ep 2, one step per variant), computes
the Mula figures for one recipe and measures defer_grad_sync; its bytes equal the analytic counts where
those are exact (no timing assertions)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # a benchmark smoke run: make test-slow

VARIANTS = {"fsdp", "zero1 ep-aware", "zero1 ep-unaware", "zero2 ep-aware", "zero2 ep-unaware",
            "zero1 ep-aware bf16-reduce"}


def test_optimizer_benchmark_measures_bytes_and_state_as_counted(tmp_path, load_benchmark):
    optimizer = load_benchmark("optimizer")
    out = tmp_path / "optimizer.json"
    optimizer.main(["--steps", "1", "--rounds", "1", "--layouts", "dp2 x ep2", "--mula", "20b", "--json", str(out)])
    payload = json.loads(out.read_text())
    rows = payload["layouts"]["dp2 x ep2"]
    assert set(rows) == VARIANTS
    for name, row in rows.items():
        assert row["opt_s"] > 0 and row["opt_cpu_s"] > 0 and row["step_s"] > row["opt_s"] and row["state_bytes"] > 0
        if name.endswith("unaware"):
            assert row["vs"] == name and row["opt_speedup"] == row["state_ratio"] == 1.0
        if name == "fsdp":
            assert row["analytic"].keys() == {"all_to_all_single"}
            continue
        # zero modes: gradient reduce-scatter, parameter all-gather and EP's all_to_all exactly as counted
        for kind in ("reduce_scatter_single", "all_gather_single", "all_to_all_single"):
            assert row["bytes"][kind] == row["analytic"][kind] > 0, (name, kind)
        if name.endswith("unaware"):  # + the all-reduce over ep of the non-expert shard (and a few scalars)
            assert 0 <= row["bytes"]["all_reduce"] - row["analytic"]["all_reduce"] < 1024
    # EP-aware: non-expert state sharded over dp x ep, so less of it per rank than EP-unaware
    assert rows["zero1 ep-aware"]["state_bytes"] < rows["zero1 ep-unaware"]["state_bytes"]
    aware, unaware = rows["zero1 ep-aware"], rows["zero1 ep-unaware"]
    assert aware["state_ratio"] == aware["state_bytes"] / unaware["state_bytes"]
    assert rows["fsdp"]["bytes"]["all_gather_single"] > rows["zero1 ep-aware"]["bytes"]["all_gather_single"]
    # bf16 gradient reduction: half the reduce-scatter's bytes, the same all-gather
    bf16, fp32 = rows["zero1 ep-aware bf16-reduce"]["bytes"], rows["zero1 ep-aware"]["bytes"]
    assert 2 * bf16["reduce_scatter_single"] == fp32["reduce_scatter_single"]
    assert bf16["all_gather_single"] == fp32["all_gather_single"]
    # zero2 reduce-scatters in every micro-batch and holds only shards; zero1 holds whole gradients
    assert rows["zero2 ep-aware"]["grad_bytes"] < rows["zero1 ep-aware"]["grad_bytes"] / 2
    (mula,) = payload["mula"]
    assert (mula["model"], mula["layout"], mula["opt_speedup_published"]) == ("mula-20b-a2b", "ep 12", 1.36)
    assert mula["state_bytes_unaware"] > mula["state_bytes_aware"] > 0
    assert mula["opt_speedup_computed"] == pytest.approx(mula["state_bytes_unaware"] / mula["state_bytes_aware"])
    defer = payload["defer_grad_sync"]
    assert set(defer) == {"none", "replicate", "all"}
    for mode, row in defer.items():
        for kind in ("reduce_scatter_single", "all_reduce"):
            assert row["bytes"][kind] == row["analytic"][kind] > 0, (mode, kind)
    assert defer["all"]["bytes"]["reduce_scatter_single"] * 2 == defer["none"]["bytes"]["reduce_scatter_single"]
    assert defer["replicate"]["bytes"]["all_reduce"] * 2 == defer["none"]["bytes"]["all_reduce"]
    assert payload["ddp"]["bytes"]["all_reduce"] == payload["ddp"]["analytic"]["all_reduce"] > 0
