"""benchmarks/checkpointing.py runs both policies and reports sane fields (no timing assertion: the figures go to
BENCHMARKS.md)."""

from __future__ import annotations

import pytest

import json

SMALL_MODEL = "--model.n_layers=1,--model.d_model=64,--model.expert_ffn_hidden=64"


@pytest.mark.slow  # real saves both ways: ~12 s on a 2-core AVX2 CPU (the flags are checked in make test)
def test_one_layout_both_policies(load_benchmark, tmp_path):
    out = tmp_path / "out.json"
    assert load_benchmark("checkpointing").main(["--only", "moe-ep2-all_to_all", "--rounds", "1",
                                                 f"--model={SMALL_MODEL}", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["layout"] == "moe-ep2-all_to_all" and row["speedup"] > 0
    assert row["grad_max_abs_diff"] == 0.0  # keeping an output or replaying its op: the same gradients
    calls = {policy: row["backward_collectives"][policy]["calls"] for policy in ("kept", "replayed")}
    # the reference's recompute runs each MoE layer's counts, dispatch and combine all-to-alls again
    assert calls["replayed"]["all_to_all_single"] == calls["kept"]["all_to_all_single"] + 3


def test_unknown_layout_is_one_line_and_exit_2(load_benchmark, capsys):
    assert load_benchmark("checkpointing").main(["--only", "nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
