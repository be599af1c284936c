"""benchmarks/host_memory.py runs both allocators and reports sane fields (no timing assertion: the figures go to
BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest

SMALL_MODEL = "--model.n_layers=1,--model.d_model=64,--model.ffn_hidden=128"


@pytest.mark.slow  # real training runs both ways: ~20 s on a 2-core AVX2 CPU (the flags are checked in make test)
def test_one_layout_each_way(load_benchmark, tmp_path, monkeypatch):
    script = load_benchmark("host_memory")
    sides = []
    run = script._run
    monkeypatch.setattr(script, "_run", lambda *args: sides.append(args[3]) or run(*args))
    out = tmp_path / "out.json"
    assert script.main(["--only", "dense-1", "--steps", "2", "--warmup", "1", "--rounds", "1",
                        f"--model={SMALL_MODEL}", "--json", str(out)]) == 0
    assert sides == [False, True]  # the reference first, then the trainer's reuse
    (row,) = json.loads(out.read_text())["rows"]
    assert row["layout"] == "dense-1" and row["glibc_step_s"] > 0 and row["reuse_step_s"] > 0
    assert row["speedup"] == pytest.approx(row["glibc_step_s"] / row["reuse_step_s"])
    assert row["glibc_peak_rss_bytes"] > 0 and row["reuse_peak_rss_bytes"] > 0


def test_unknown_layout_is_one_line_and_exit_2(load_benchmark, capsys):
    assert load_benchmark("host_memory").main(["--only", "nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
