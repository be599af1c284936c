"""benchmarks/metrics_log.py on a small synthetic log: every reading runs, in its own process, and the table and
JSON name each with its kind; the synthetic log is what the readers take for a run's."""

from __future__ import annotations

import json

from optimus.report.records import RunRecords


def test_every_reading_is_measured_against_reading_whole(load_benchmark, tmp_path, capsys):
    script = load_benchmark("metrics_log")
    out = tmp_path / "out.json"
    assert script.main(["--steps", "12", "--layers", "2", "--experts", "4", "--ranks", "16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["reading"], r["kind"]) for r in report["rows"]] == [
        ("imports only", "baseline"), ("read whole", "reference"), ("report page", "ours"), ("loss plot", "ours"),
        ("resume rewind", "ours")]
    assert all(r["peak_rss_bytes"] > 0 and r["wall_s"] >= 0 for r in report["rows"])
    assert report["log_bytes"] > 0 and "read whole" in capsys.readouterr().out


def test_the_synthetic_log_reads_as_a_run_log(load_benchmark, tmp_path):
    script = load_benchmark("metrics_log")
    script.write_log(tmp_path / "metrics.jsonl", steps=5, layers=3, experts=8, ranks=16)
    records = RunRecords.read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records.steps] == [1, 2, 3, 4, 5]
    assert records.expert_loads.highest.shape == (5, 3) and len(records.last_memory_per_rank) == 16


def test_bad_sizes_are_one_line(load_benchmark, capsys):
    script = load_benchmark("metrics_log")
    assert script.main(["--steps", "5"]) == 2
    assert capsys.readouterr().err.strip().startswith("--steps must exceed 10")
