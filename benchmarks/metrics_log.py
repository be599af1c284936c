"""A long run's metrics.jsonl read as the trainer and `optimus report` read it vs read whole, in the same run.

Ours goes line by line and keeps what it draws (optimus/report/records.py, train/callbacks/jsonl.py); the
reference parses every record into one list, as a whole-file reader must (what those readers did until
2026-11-27). Each reading runs in a fresh process; the table gives its peak resident set above a process that
only imports the same modules, and its wall time.

The log is synthetic, shaped as a large MoE job logs every step: by default Mula-220B-A10B's 64 layers x 240
experts of expert counts and 3,072 ranks' peak memory (a 100B-token run at Aurora's batch is ~15,900 steps; the
default 1,000 keep the benchmark to a minute).

    python benchmarks/metrics_log.py [--steps 1000] [--layers 64] [--experts 240] [--ranks 3072] [--json F]
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
from benchmarks._common import machine_info  # noqa: E402

IMPORTS = ("import json, resource, sys, time; from pathlib import Path; "
           "from optimus.report.page import render_report; from optimus.train.callbacks.plot import plot_losses; "
           "from optimus.train.callbacks.jsonl import rewind_metrics")
READINGS = {  # name -> (what it is, code run on `run` (the run folder) and `log` (its metrics.jsonl))
    "imports only": ("baseline", "pass"),
    "read whole": ("reference", "records = [json.loads(line) for line in log.open('rb')]"),
    "report page": ("ours", "render_report(run)"),
    "loss plot": ("ours", "plot_losses(log, run / 'loss.png')"),
    "resume rewind": ("ours", "rewind_metrics(log, STEPS - 10)"),
}


def write_log(path: Path, steps: int, layers: int, experts: int, ranks: int, seed: int = 0) -> None:
    """`steps` step records as the trainer logs them (the scalars, every rank's peak memory, the expert counts)."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for step in range(1, steps + 1):
            record = {"step": step, "loss": 10.0 / (1 + step / 100), "ce_loss": 10.0 / (1 + step / 100), "lr": 4e-4,
                      "grad_norm": 1.0, "tokens_seen": step * 6_291_456, "skipped": False, "tokens_per_s": 1e6,
                      "tokens_per_s_per_device": 1e6 / ranks, "mfu": 0.3,
                      "memory_peak_gib": [round(40 + rng.random(), 4) for _ in range(ranks)],
                      "expert_load_max": 1.5, "expert_load_min": 0.5,
                      "expert_counts": [[rng.randint(4000, 9000) for _ in range(experts)] for _ in range(layers)]}
            handle.write(json.dumps(record) + "\n")


def measure(name: str, run: Path, steps: int) -> dict:
    """Peak resident set (bytes) and wall time of one reading, in a fresh interpreter."""
    code = (f"{IMPORTS}; run = Path({str(run)!r}); log = run / 'metrics.jsonl'; STEPS = {steps}; "
            f"start = time.perf_counter(); {READINGS[name][1]}; wall = time.perf_counter() - start; "
            "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024; "
            "print(json.dumps({'peak_rss': peak, 'wall_s': wall}))")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--experts", type=int, default=240)
    parser.add_argument("--ranks", type=int, default=3072)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if min(args.steps, args.layers, args.experts, args.ranks) < 1 or args.steps <= 10:
        print("--steps must exceed 10 and --layers, --experts, --ranks be at least 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder)
        write_log(run / "metrics.jsonl", args.steps, args.layers, args.experts, args.ranks)
        size = (run / "metrics.jsonl").stat().st_size
        results = {}
        for name in READINGS:  # the rewind cuts the log: it runs last
            results[name] = measure(name, run, args.steps)
    base = results["imports only"]["peak_rss"]
    reference = results["read whole"]["peak_rss"] - base
    rows = []
    print(f"metrics.jsonl of {args.steps:,} steps x ({args.layers} x {args.experts} expert counts, {args.ranks:,} "
          f"ranks' memory): {size / 2**20:,.0f} MiB")
    print(f"{'reading':16} {'kind':10} {'peak RSS above imports':>24} {'vs read whole':>14} {'wall s':>8}")
    for name, (kind, _) in READINGS.items():
        above = results[name]["peak_rss"] - base
        measurable = name != "imports only" and above >= 2**20  # below a MiB: within the imports' own noise
        ratio = reference / above if measurable else None
        rows.append({"reading": name, "kind": kind, "peak_rss_bytes": results[name]["peak_rss"],
                     "above_imports_bytes": above, "reference_over_this": ratio, "wall_s": results[name]["wall_s"]})
        shown = (f"{ratio:.1f}x" if ratio is not None else "" if name == "imports only"
                 else f"> {reference / 2**20:.0f}x")
        print(f"{name:16} {kind:10} {above / 2**20:>20,.0f} MiB {shown:>14} {results[name]['wall_s']:>8.1f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_info(), "steps": args.steps, "layers": args.layers,
                                         "experts": args.experts, "ranks": args.ranks, "log_bytes": size,
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
