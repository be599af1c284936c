"""benchmarks/ep_dispatch.py on a one-layer tiny MoE: both dispatches timed in the same ranks, the same gradients,
and the allgather's exchanged bytes exactly what the planner prices."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed


def test_both_dispatches_measured_in_the_same_ranks(load_benchmark, tmp_path):
    script = load_benchmark("ep_dispatch")
    out = tmp_path / "out.json"
    assert script.main(["--rounds", "1", "--model=--model.n_layers=1,--train.seq_len=32", "--json", str(out)]) == 0
    rows = {r["dispatch"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"allgather", "all_to_all"} and all(r["step_s"] > 0 for r in rows.values())
    assert rows["allgather"]["collectives"]["ep_bytes"] == rows["allgather"]["ep_bytes_planned"]
    assert all(r["grad_max_abs_diff"] < 1e-5 for r in rows.values())


@pytest.mark.slow  # a second real 4-rank run of the script (make test keeps the first): ~20 s on 2 cores
def test_under_tp_only_the_ep_groups_exchanges_are_counted(load_benchmark, tmp_path):
    """TP 2 x EP 2 (4 ranks, zero1): the same ops also gather the sequence over tp; counted over the ep group alone,
    the allgather moves what the planner prices (each tp rank the whole micro-batch), and both dispatches agree."""
    script = load_benchmark("ep_dispatch")
    out = tmp_path / "out.json"
    argv = ["--rounds", "1", "--layout", "tp2-ep2-zero1", "--model=--model.n_layers=1,--train.seq_len=32"]
    assert script.main([*argv, "--json", str(out)]) == 0
    rows = {r["dispatch"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["allgather"]["collectives"]["ep_bytes"] == rows["allgather"]["ep_bytes_planned"]
    assert all(r["grad_max_abs_diff"] < 1e-5 for r in rows.values())


def test_bad_rounds_are_one_line(load_benchmark, capsys):
    assert load_benchmark("ep_dispatch").main(["--rounds", "0"]) == 2
    assert capsys.readouterr().err.strip() == "--rounds must be at least 1 (got 0)"
