"""The step times and memory plan_vs_measured.py measured here, stored, priced by the planner as it is now.

    python benchmarks/plan_here_stored.py [--stored benchmarks/here_measured.json] [--json F]
    python benchmarks/plan_here_stored.py --stored benchmarks/here_measured_xeon_amx.json   # an Intel Xeon with AMX's
    python benchmarks/plan_here_stored.py --stored benchmarks/here_measured_epyc_avx2.json  # an AVX2-only EPYC's
    python benchmarks/plan_here_stored.py --add RESULTS.json [--add ...]   # store a plan_vs_measured run's rows

Runs nothing and times nothing: each stored row holds its layout (config and overrides), what was measured (the
allocator's peak; the fastest run's median step) and, for a step time, what its prediction was priced from when it was
measured (each calibration's op-class efficiencies and the cores' share, and the gloo collectives table it was priced
on: the run's, or the row's own under plan_vs_measured.py --row-tables; each distinct timing is written once), so
the planner as it is now prices it as plan_vs_measured.py would have at that moment. A change to the planner made
without re-timing every layout (a full re-time takes over an hour and a half on 2 cores) shows at once what it does
to each; tests/benchmarks/test_plan_here_stored.py holds every row to issue 11's bands. `--add` takes a
plan_vs_measured.py JSON: its allocator-peak readings replace the same layouts' memory rows, its timed rows that say
what they were priced from replace their time rows.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
from benchmarks._common import machine_info, prediction_accuracy, run_script, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "benchmarks" / "here_measured.json"
ABOUT = ("Readings of benchmarks/plan_vs_measured.py on this project's 2-core CPU (the machine below): memory the "
         "allocator's peak (each rank's least over its profiled runs, the largest rank's), step time the fastest run's "
         "median step with what its prediction was priced from; `python benchmarks/plan_here_stored.py` prices them "
         "with the planner as it is now.")


def _layout(row: dict):
    from benchmarks.plan_vs_measured import _layout

    return _layout(str(ROOT / row["config"]), row["ranks"], row["overrides"])


def memory_rows(stored: dict) -> list[dict]:
    """Each stored memory reading beside the planner's prediction now (plan_vs_measured's: the largest rank of the
    first and last stage, plus the data pipeline's batches)."""
    from benchmarks.plan_vs_measured import host_extras, predicted_memory_bytes

    rows = []
    for row in stored["memory"]["rows"]:
        layout = _layout(row)
        predicted = predicted_memory_bytes(layout) + host_extras(layout.config)
        rows.append({**row, "predicted_memory_bytes": predicted,
                     "memory_error": predicted / row["measured_memory_bytes"] - 1})
    return rows


def time_rows(stored: dict) -> list[dict]:
    """Each stored step time beside the planner's prediction now: the mean over the calibrations it was priced from
    (plan_vs_measured.predict), each on its run's collectives table."""
    from benchmarks.plan_vs_measured import priced_steps
    from optimus.plan.here import here_cluster

    tables = stored["time"]["tables"]
    rows = []
    for row in stored["time"]["rows"]:
        entries = [{"machine": {**priced["machine"], "collectives": tables[row["table"]]},
                    **({"efficiency": priced["efficiency"]} if priced["efficiency"] else {})}
                   for priced in row["priced_from"]]
        clusters = [here_cluster(entry, row["ranks"], row["threads"]) for entry in entries]
        steps = [t.step_s for t in priced_steps(_layout(row), clusters)]
        predicted = statistics.mean(steps)
        rows.append({**{k: v for k, v in row.items() if k != "priced_from"}, "predicted_step_s": predicted,
                     "step_error": predicted / row["measured_step_s"] - 1})
    return rows


def _read(path: Path, what: str, keys: tuple[str, ...]) -> dict:
    """A JSON file with `keys` at its top; SystemExit with one line when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        for key in keys:
            data[key]  # noqa: B018 - its shape, checked
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"plan_here_stored: {path}: not {what} ({type(error).__name__}: {error})") from None
    return data


def compact_json(value, depth: int = 0) -> str:
    """JSON one level a line, but a list or mapping of plain values on one line: each collective timing, override list
    and efficiency set reads as one line: the file diffs row by row in a quarter fewer bytes than indent=1's."""
    if not isinstance(value, (dict, list)) or not any(isinstance(v, (dict, list))
                                                       for v in (value.values() if isinstance(value, dict) else value)):
        return json.dumps(value)
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {compact_json(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    return "[\n" + ",\n".join(f"{inner}{compact_json(v, depth + 1)}" for v in value) + f"\n{pad}]"


def pack_timings(stored: dict) -> dict:
    """The readings as written: each distinct collective timing once (time.timings), a table's rows its indices
    there. A row's own table (--row-tables) re-times only its job size and carries the rest from the cached table, so
    most of a table's timings are another table's too: the file keeps 4,440 of 10,800 (2026-11-30)."""
    timings: dict[str, int] = {}
    tables = []
    for table in stored["time"]["tables"]:
        ids = [timings.setdefault(json.dumps(row, sort_keys=True), len(timings)) for row in table["rows"]]
        tables.append({**table, "rows": ids})
    return {**stored, "time": {**stored["time"], "timings": [json.loads(t) for t in timings], "tables": tables}}


def unpack_timings(stored: dict) -> dict:
    """pack_timings undone (a file written before it packed reads as it is)."""
    if "timings" not in stored["time"]:
        return stored
    timing = stored["time"]["timings"]
    tables = [{**table, "rows": [timing[i] for i in table["rows"]]} for table in stored["time"]["tables"]]
    return {**stored, "time": {k: v for k, v in stored["time"].items() if k != "timings"} | {"tables": tables}}


def read_stored(path: Path = STORED) -> dict:
    """The stored readings, each table with its timings; SystemExit with one line when the file is not one."""
    stored = _read(path, "a file of stored readings like benchmarks/here_measured.json", ("machine", "memory", "time"))
    try:
        return unpack_timings(stored)
    except (KeyError, TypeError, IndexError) as error:
        raise SystemExit(f"plan_here_stored: {path}: a table's timings are not in the file "
                         f"({type(error).__name__}: {error})") from None


def add_run(stored: dict, results: dict) -> tuple[int, int]:
    """Store a plan_vs_measured.py run's readings (rows of the same layout replaced); (memory, time) rows taken."""
    from benchmarks.plan_vs_measured import BASE, LAYOUTS

    date = results["machine"]["date"]
    memory = {r["layout"]: r for r in stored["memory"]["rows"]}
    timed = {r["layout"]: r for r in stored["time"]["rows"]}
    tables = stored["time"]["tables"]
    took = [0, 0]
    for row in results["rows"]:
        config, ranks, extra = LAYOUTS[row["layout"]]
        # a run before rows named their overrides ran the table's own (its --model empty)
        layout = {"layout": row["layout"], "ranks": ranks, "config": row.get("config", config),
                  "overrides": [o for o in row.get("config_overrides", [*BASE, *extra])
                                if not o.startswith("--train.max_steps=")], "date": date}
        if row.get("memory_measure") == "allocator peak":
            memory[row["layout"]] = {**layout, "measured_memory_bytes": row["measured_memory_bytes"]}
            took[0] += 1
        # the table the row was priced on: its own where it timed one (--row-tables), else the run's
        table = row.get("collectives", results.get("collectives"))
        if "priced_from" in row and table is not None:
            if table not in tables:
                tables.append(table)
            timed[row["layout"]] = {**layout, "threads": row["threads"], "measured_step_s": row["measured_step_s"],
                                    "priced_from": row["priced_from"], "table": tables.index(table)}
            took[1] += 1
    stored["memory"]["rows"], stored["time"]["rows"] = list(memory.values()), list(timed.values())
    # tables no row uses any more go
    used = sorted({r["table"] for r in stored["time"]["rows"]})
    for row in stored["time"]["rows"]:
        row["table"] = used.index(row["table"])
    stored["time"]["tables"] = [tables[i] for i in used]
    return took[0], took[1]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stored", default=str(STORED), help="the stored readings (default: %(default)s)")
    parser.add_argument("--add", action="append", default=[], metavar="RESULTS",
                        help="a plan_vs_measured.py JSON whose readings to store (then the file is written)")
    parser.add_argument("--json", default="benchmarks/results/plan_here_stored.json", help="where to write the rows")
    args = parser.parse_args(argv)
    stored_path = Path(args.stored)
    if args.add:
        stored = (read_stored(stored_path) if stored_path.exists() else
                  {"about": ABOUT, "machine": {}, "memory": {"rows": []}, "time": {"tables": [], "rows": []}})
        stored["about"] = ABOUT
        for path in args.add:
            results = _read(Path(path), "a plan_vs_measured.py JSON", ("machine", "rows"))
            stored["machine"] = {"cpu": results["machine"]["machine"], "torch": results["machine"]["torch"]}
            print(f"{path}: {'%d memory and %d time rows' % add_run(stored, results)} stored")
        stored_path.write_text(compact_json(pack_timings(stored)) + "\n")
        print(f"wrote {stored_path}")
    stored = read_stored(stored_path)
    try:
        memory, timed = memory_rows(stored), time_rows(stored)
    except (KeyError, TypeError, ValueError, IndexError) as error:  # a row without what pricing it needs
        raise SystemExit(f"plan_here_stored: {stored_path}: a row lacks what pricing it needs "
                         f"({type(error).__name__}: {error})") from None
    print(f"readings on {stored['machine'].get('cpu')} (torch {stored['machine'].get('torch')}), priced by the "
          "planner as it is now")
    if timed:
        print(f"{'layout':<40} {'ranks':>5} {'measured s':>10} {'predicted s':>11} {'err':>7}  measured")
        for row in timed:
            print(f"{row['layout']:<40} {row['ranks']:>5} {row['measured_step_s']:>10.3f} "
                  f"{row['predicted_step_s']:>11.3f} {row['step_error']:>+7.1%}  {row['date']}")
        print(f"step time within 15%: {sum(abs(r['step_error']) <= 0.15 for r in timed)}/{len(timed)}")
        print(prediction_accuracy([r["step_error"] for r in timed]))
    if memory:
        worst = max(memory, key=lambda r: abs(r["memory_error"]))
        print(f"memory: within 10%: {sum(abs(r['memory_error']) <= 0.10 for r in memory)}/{len(memory)}; mean "
              f"absolute error {statistics.mean(abs(r['memory_error']) for r in memory):.1%}, largest "
              f"{worst['memory_error']:+.1%} ({worst['layout']})")
    write_json(args.json, {"machine": machine_info(), "stored": str(stored_path), "time": timed, "memory": memory})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    run_script(main)
