"""benchmarks/plan_here_stored.py: what plan_vs_measured.py measured here, stored (benchmarks/here_measured.json, on
the project's AMD EPYC with AVX512-BF16; here_measured_xeon_amx.json, on an Intel Xeon with AMX;
here_measured_epyc_avx2.json, on an AVX2-only AMD EPYC), priced by the planner as it is now,
stays within issue 11's bands (memory 10%, step time 15%): a change to the planner cannot move a layout's prediction
out of them unseen, on either CPU kind. A run's JSON is stored row by row and priced again exactly; a file that is not
one is one line."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def stored_script(load_benchmark):
    return load_benchmark("benchmarks.plan_here_stored")


# each stored file and the fewest (memory, step time) readings it holds: on the EPYC every layout plan_vs_measured.py
# trains (its multi-rank ones timed); on the Xeon the 27 layouts one session timed (stop 60), every bf16-compute one
# among them; on the AVX2-only EPYC its 19 fp32 layouts of those (stop 61)
STORED_FILES = {"here_measured.json": (98, 90), "here_measured_xeon_amx.json": (27, 27),
                "here_measured_epyc_avx2.json": (19, 19)}
# The step times the planner misses on the Xeon, out of sample (BENCHMARKS.md, stop 60), each held to the error it
# read: the loss head and expert GEMMs cost another time inside those steps than their calibration timed them, slower
# in AMX bf16 and faster in fp32 (the lead: that VM's memory-bound work moved 2x minutes apart while its matmul rate
# held). A fix moves them inside 15% (then drop them here); none may widen.
KNOWN_STEP_MISSES = {"here_measured_xeon_amx.json": {
    "moe-1": 0.24, "moe-1-bf16": -0.17, "moe-fsdp2-ep2-bf16": -0.34, "moe-fsdp2-ep2-bf16-bf16-reduce-mb2": -0.28,
    "moe-zero1-4": 0.22},
    # out of sample on the AVX2-only EPYC (stop 61): the MoE zero modes at 3 and 4 ranks on 2 cores priced slow (as
    # moe-zero1-4 on the Xeon, and the largest error on the AVX512 EPYC, +12%), a 4-rank pipeline with ep fast
    "here_measured_epyc_avx2.json": {"moe-zero2-3-mb2": 0.31, "moe-zero1-4": 0.28, "moe-pp2-ep2": -0.16}}


@pytest.fixture(params=sorted(STORED_FILES))
def stored_file(request, stored_script):
    return stored_script.ROOT / "benchmarks" / request.param, STORED_FILES[request.param]


def test_every_stored_memory_reading_is_predicted_within_10_percent(stored_script, stored_file):
    path, (readings, _) = stored_file
    rows = stored_script.memory_rows(stored_script.read_stored(path))
    assert len(rows) >= readings
    outside = {r["layout"]: round(r["memory_error"], 3) for r in rows if abs(r["memory_error"]) > 0.10}
    assert not outside


def test_every_stored_step_time_is_predicted_within_15_percent(stored_script, stored_file):
    path, (_, readings) = stored_file
    rows = stored_script.time_rows(stored_script.read_stored(path))
    assert len(rows) >= readings
    known = KNOWN_STEP_MISSES.get(path.name, {})
    outside = {r["layout"]: round(r["step_error"], 3) for r in rows
               if abs(r["step_error"]) > 0.15 and r["layout"] not in known}
    assert not outside
    # a known miss inside 15% now, or no wider than it read, on the side it read
    widened = {r["layout"]: round(r["step_error"], 3) for r in rows if r["layout"] in known
               and abs(r["step_error"]) > 0.15 and not 0 <= r["step_error"] / known[r["layout"]] <= 1}
    assert not widened


def test_a_runs_rows_are_stored_and_priced_again_as_they_were(stored_script, tmp_path):
    stored = stored_script.read_stored()
    row = stored["time"]["rows"][0]
    results = {"machine": {"date": "2026-11-29 12:00 UTC", "machine": "test CPU", "torch": "t"},
               "collectives": stored["time"]["tables"][row["table"]],
               "rows": [{"layout": row["layout"], "threads": row["threads"], "measured_step_s": 2.0,
                         "priced_from": row["priced_from"], "memory_measure": "allocator peak",
                         "measured_memory_bytes": 123, "config": row["config"],
                         "config_overrides": [*row["overrides"], "--train.max_steps=6"]}]}
    fresh = {"memory": {"rows": []}, "time": {"tables": [], "rows": []}}
    assert stored_script.add_run(fresh, results) == (1, 1)
    assert fresh["memory"]["rows"][0]["measured_memory_bytes"] == 123
    assert fresh["time"]["rows"][0]["overrides"] == row["overrides"]  # the run's length is not the layout's
    again = stored_script.time_rows(fresh)[0]
    before = next(r for r in stored_script.time_rows(stored) if r["layout"] == row["layout"])
    assert again["predicted_step_s"] == before["predicted_step_s"]
    assert again["step_error"] == pytest.approx(before["predicted_step_s"] / 2.0 - 1)
    # the same layout again replaces its rows; the table is kept once
    assert stored_script.add_run(fresh, results) == (1, 1)
    assert len(fresh["time"]["rows"]) == len(fresh["memory"]["rows"]) == len(fresh["time"]["tables"]) == 1


def test_a_row_with_its_own_table_is_stored_and_priced_on_it(stored_script):
    """A row plan_vs_measured.py --row-tables priced on its own collectives keeps that table, not the run's."""
    stored = stored_script.read_stored()
    row = next(r for r in stored["time"]["rows"] if r["ranks"] > 1)
    table = stored["time"]["tables"][row["table"]]
    slower = {**table, "rows": [{**r, "seconds": 3 * r["seconds"]} for r in table["rows"]]}
    results = {"machine": {"date": "2026-11-29 12:00 UTC", "machine": "test CPU", "torch": "t"},
               "collectives": table,
               "rows": [{"layout": row["layout"], "threads": row["threads"], "measured_step_s": 2.0,
                         "priced_from": row["priced_from"], "config": row["config"], "collectives": slower,
                         "config_overrides": row["overrides"]}]}
    fresh = {"memory": {"rows": []}, "time": {"tables": [], "rows": []}}
    assert stored_script.add_run(fresh, results) == (0, 1)
    assert fresh["time"]["tables"] == [slower]
    on_run_table = {**fresh, "time": {"tables": [table], "rows": fresh["time"]["rows"]}}
    assert stored_script.time_rows(fresh)[0]["predicted_step_s"] > \
        stored_script.time_rows(on_run_table)[0]["predicted_step_s"]


def test_stored_readings_are_written_a_plain_row_a_line_and_read_back_unchanged(stored_script, tmp_path):
    """pack_timings + compact_json: each distinct timing once and on one line; the file reads back as written."""
    stored = stored_script.read_stored()
    text = stored_script.compact_json(stored_script.pack_timings(stored))
    assert stored_script.unpack_timings(json.loads(text)) == stored
    timing = stored["time"]["tables"][0]["rows"][0]
    assert sum(line.strip().rstrip(",") == json.dumps(timing, sort_keys=True) for line in text.splitlines()) == 1
    assert len(text) < 0.5 * len(json.dumps(stored, indent=1))
    (tmp_path / "packed.json").write_text(text)
    assert stored_script.read_stored(tmp_path / "packed.json") == stored
    broken = json.loads(text)
    broken["time"]["timings"] = broken["time"]["timings"][:1]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(SystemExit, match="a table's timings are not in the file"):
        stored_script.read_stored(tmp_path / "broken.json")
    assert stored_script.compact_json({"a": [], "b": {}, "c": [1, {"d": 2}]}) == \
        '{\n "a": [],\n "b": {},\n "c": [\n  1,\n  {"d": 2}\n ]\n}'


def test_a_file_that_is_not_stored_readings_is_one_line(stored_script, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"memory": {"rows": []}}))
    with pytest.raises(SystemExit, match="not a file of stored readings"):
        stored_script.main(["--stored", str(bad), "--json", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit, match="not a plan_vs_measured.py JSON"):
        stored_script.main(["--stored", str(tmp_path / "new.json"), "--add", str(bad)])
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "new.json").exists()
