"""Training steps on the CPU with freed host memory kept for reuse (what the trainer does, train/host_memory.py)
vs glibc's default allocator (large blocks mapped fresh from the kernel and handed back on free), in one run.

    PYTHONPATH=. python benchmarks/host_memory.py [--json benchmarks/results/host_memory.json]
        [--only dense-1,moe-pp2-ep2] [--steps 4] [--warmup 2] [--rounds 2] [--model --model.n_layers=1,...]

Each layout is benchmarks/plan_vs_measured.py's (the same configs, sizes and forked gloo ranks), trained
`rounds` times each way, the two alternating; a run's step is the median of its steps after the warm-up, each side
keeps its fastest run, and the speedup is default / reuse. The reference side is the same training with
train.reuse_host_memory=false. Also reported: the largest peak resident set of a rank each way (reuse keeps
freed blocks mapped).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import machine_info, write_json  # noqa: E402
from benchmarks.plan_vs_measured import BASE, LAYOUTS, ROOT, _measured_steps, _metrics, _rss  # noqa: E402
from optimus.config import load_config  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

DEFAULT_LAYOUTS = ("dense-1", "moe-1", "dense-fsdp2", "moe-fsdp4-ep4", "moe-pp2-ep2", "dense-tp2-pp2")


def _train_rank(rank: int, world: int, config_path: str, overrides: list[str], reuse: bool) -> int:
    """(one forked rank) train as `optimus train` does, with or without the reuse; return the peak resident set."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group exists already: init_distributed returns
    from optimus.train.trainer import Trainer

    Trainer(load_config(config_path, [*overrides, f"--train.reuse_host_memory={str(reuse).lower()}"]),
            progress_bar=False).fit()
    return _rss()[1]


def _run(name: str, steps: int, warmup: int, reuse: bool, model: list[str] = ()) -> tuple[float, int]:
    """One training of layout `name`: (its median step after the warm-up, the largest rank's peak resident set)."""
    config_path, ranks, extra = LAYOUTS[name]
    config_path = str(ROOT / config_path)
    with tempfile.TemporaryDirectory(prefix="optimus-hostmem-") as tmp:
        overrides = [*BASE, *model, *extra, f"--train.max_steps={warmup + steps}", f"--run.dir={tmp}/run"]
        config = load_config(config_path, overrides)
        peaks = run_distributed(_train_rank, ranks, config_path, overrides, reuse, timeout=900.0)
        tokens_per_step = config.train.global_batch_size * config.train.seq_len
        measured = _measured_steps(_metrics(Path(tmp) / "run"), warmup, tokens_per_step)
    return statistics.median(measured), max(peaks)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="benchmarks/results/host_memory.json")
    parser.add_argument("--only", default=",".join(DEFAULT_LAYOUTS), help="comma-separated layout names")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="runs each way per layout, alternating")
    parser.add_argument("--model", default="", help="extra --model.* overrides for every layout, comma-separated "
                                                    "(a smaller model for a quick check)")
    args = parser.parse_args(argv)
    names, model = args.only.split(","), [m for m in args.model.split(",") if m]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"unknown layout {unknown[0]}: choose from {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print(f"{'layout':<26} {'ranks':>5} {'glibc s':>8} {'reuse s':>8} {'speedup':>8} {'RSS MiB':>8} {'reuse':>8}",
          flush=True)
    rows = []
    for name in names:
        runs: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for reuse in (False, True):
                runs[reuse].append(_run(name, args.steps, args.warmup, reuse, model))
        default, reused = (min(runs[side]) for side in (False, True))
        row = {"layout": name, "ranks": LAYOUTS[name][1], "glibc_step_s": default[0], "reuse_step_s": reused[0],
               "speedup": default[0] / reused[0], "glibc_peak_rss_bytes": default[1], "reuse_peak_rss_bytes": reused[1],
               "runs": {"glibc": runs[False], "reuse": runs[True]}}
        rows.append(row)
        print(f"{name:<26} {row['ranks']:>5} {default[0]:>8.3f} {reused[0]:>8.3f} {row['speedup']:>7.2f}x "
              f"{default[1] / 2**20:>8.0f} {reused[1] / 2**20:>8.0f}", flush=True)
    write_json(args.json, {"benchmark": "host_memory", **machine_info(), "steps": args.steps, "warmup": args.warmup,
                           "rounds": args.rounds, "model": model, "rows": rows})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
