"""The planner beside the published figures (REFERENCE.md): Frontier, Aurora, LUMI, from the cluster presets alone.

    PYTHONPATH=. python benchmarks/plan_published.py [--json benchmarks/results/plan_published.json] [--no-search]

Each row: the published figure, ours, the band the issue allows (5 points for efficiencies, exact for LUMI's
GCD count, 5% of step time for the Aurora layout ranking), and whether it is met. The cases, their sources and
every assumption live in optimus/plan/published.py (the regression test in tests/unit/plan reads the same ones).
--no-search leaves out the two Aurora comparisons that run the layout search (a couple of minutes on 2 cores).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from optimus.cli.errors import OneLineErrorParser  # noqa: E402
from _common import machine_info, run_script  # noqa: E402

from optimus.plan import published  # noqa: E402


def _figure(x: float, fraction: bool) -> str:
    return f"{x:.1%}" if fraction else f"{x:g}"


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/plan_published.json", help="where to write the rows")
    parser.add_argument("--no-search", action="store_true", help="skip the Aurora comparisons that search layouts")
    args = parser.parse_args()
    groups = [published.energy, published.lumi, published.frontier, published.frontier_scaling, published.aurora_weak_scaling]
    if not args.no_search:
        groups += [published.aurora_layout, published.aurora_scaling]
    rows = []
    print(f"{'case':<100} {'published':>9} {'ours':>7} {'band':>6}  met")
    for group in groups:
        for row in group():
            rows.append(row)
            band = "exact" if row.band == 0 else _figure(row.band, row.fraction)
            note = f"\n    {row.note}" if row.note else ""
            print(f"{row.case:<100.100} {_figure(row.published, row.fraction):>9} {_figure(row.ours, row.fraction):>7} "
                  f"{band:>6}  {'yes' if row.met else 'NO'}{note}\n    source: {row.source}", flush=True)
    print(f"{sum(r.met for r in rows)} of {len(rows)} within their bands")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "plan_published", **machine_info(),
                                "rows": [r.to_dict() for r in rows]}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    run_script(main)
