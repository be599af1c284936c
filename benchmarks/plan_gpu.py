"""The planner's prediction for one GPU, from its cluster preset alone, vs short real trainings on that GPU.

    python benchmarks/plan_gpu.py [--cluster h100|h200] [--steps 5] [--warmup 3] [--only NAME,...]
        [--json bench-results/gpu/plan_gpu.json]
    python benchmarks/plan_gpu.py --stored [benchmarks/gpu_measured.json] [--json F]   # no GPU needed

Each case trains in this process as `optimus train` does on one GPU (the Trainer on cuda:0, `dtype: auto`, i.e.
bf16 autocast over fp32 weights and AdamW state), for warm-up + measured steps, and reads
  * the step time: the median measured step, from the run's metrics.jsonl (tokens per step / tokens_per_s), and
  * the memory: torch.cuda.max_memory_allocated over the whole run, reset just before the Trainer is built (the
    allocator's peak of live tensors, as the issue asks; the cache around them is not counted),
and sets beside them the planner's step_time and stage_memory for the same validated layout on one device of
the cluster preset (default: the preset whose device name the GPU's name holds) with no calibration: the
preset's datasheet peaks and efficiencies, as `optimus plan --cluster NAME` uses them. The cases are Mula
shapes that fit one GPU: Mula-1B whole (with and without full activation checkpointing) and Mula-7B-A1B's
block with fewer layers (its 64 experts, top-8), with and without selective checkpointing.

`--stored` runs nothing: it prices the steps measured on the GPUs this project was lent (gpu_measured.json, one
entry per run: device, preset, date, torch, each case's measured step and peak) with the planner as it is now, so
a change made where no GPU is lent still shows what it does to the GPU predictions.

Checkpointing and the end-of-run evaluation are left out of these runs (their callbacks are removed): they
are not in the step the planner prices, and a 1B model's checkpoint would cost more than the steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import machine_info, prediction_accuracy, run_script, write_json  # noqa: E402
from optimus.cli.plan import RESET_DEGREES  # noqa: E402
from optimus.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "benchmarks" / "gpu_measured.json"
# one device: every parallel degree 1 (the configs carry their published layouts)
ONE_DEVICE = [*RESET_DEGREES, "--parallel.shard_mode=fsdp"]
BASE = ["--train.seq_len=2048", "--train.global_batch_size=16", "--train.log_every=1", "--train.eval_every=0",
        "--train.report=false", "--train.loss_plot=false", "--optim.warmup_steps=1"]
# name -> (config, overrides)
CASES: dict[str, tuple[str, list[str]]] = {
    "mula-1b": ("configs/mula-1b.yaml", ["--train.micro_batch_size=4"]),
    "mula-1b-full-ac": ("configs/mula-1b.yaml", ["--train.micro_batch_size=8", "--train.activation_checkpointing=full"]),
    # half the launches of mula-1b, yet (one H100, 2026-11-26) about its GPU idle: what a per-operator cost misses
    "mula-1b-mbs8": ("configs/mula-1b.yaml", ["--train.micro_batch_size=8"]),
    "mula-7b-a1b-4l": ("configs/mula-7b-a1b.yaml", ["--model.n_layers=4", "--train.micro_batch_size=4"]),
    "mula-7b-a1b-4l-selective": ("configs/mula-7b-a1b.yaml", ["--model.n_layers=4", "--train.micro_batch_size=8",
                                                              "--train.activation_checkpointing=selective"]),
}


def case_overrides(name: str, steps: int, warmup: int, more: list[str] = ()) -> tuple[str, list[str]]:
    """(config path, overrides) of case `name` on one device for warm-up + measured steps, `more` appended."""
    config_path, extra = CASES[name]
    return str(ROOT / config_path), [*ONE_DEVICE, *BASE, *extra, *more, f"--train.max_steps={warmup + steps}"]


def priced_trainer(config_path: str, overrides: list[str], run_dir: str):
    """The Trainer as `optimus train` builds it, less what the planner does not price in a step: no checkpoint (a
    1B model's would outlast the run), no evaluation at the end."""
    from optimus.train.trainer import Trainer

    trainer = Trainer(load_config(config_path, [*overrides, f"--run.dir={run_dir}"]), progress_bar=False)
    trainer.callbacks = [c for c in trainer.callbacks if c not in (trainer.checkpointing, trainer.evaluation)]
    return trainer


def add_case_arguments(parser: argparse.ArgumentParser, steps: int, steps_help: str, json_default: str) -> None:
    """The arguments plan_gpu.py and step_profile.py share: the preset, the cases, their steps, extra overrides."""
    parser.add_argument("--cluster", default=None, help="the preset to compare with (default: from the GPU's name)")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--json", default=json_default)
    parser.add_argument("--override", action="append", default=[],
                        help="an extra config override for every case, e.g. --override=--train.compile=true")


def selected_cases(args: argparse.Namespace, script: str) -> tuple[str, str, list[str]]:
    """(the GPU's name, the preset, the case names) of parsed `args`; SystemExit without a GPU or for an unknown
    case."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA (or ROCm) GPU")
    device_name = torch.cuda.get_device_name(0)
    names = args.only.split(",") if args.only else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"{script}: unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    return device_name, args.cluster or cluster_for_device(device_name), names


def cluster_for_device(name: str) -> str:
    """The preset whose device this GPU is (an H200 is not an H100: the more specific name first)."""
    for preset in ("h200", "h100", "a100"):
        if preset in name.lower():
            return preset
    raise SystemExit(f"plan_gpu: no cluster preset for the GPU '{name}': pass --cluster NAME")


def predict(config_path: str, overrides: list[str], cluster_name: str) -> dict:
    """The planner's step time (and parts) and memory (by term) for this layout on one device of the preset."""
    from optimus.parallel.validate import validate_layout
    from optimus.plan.cluster import load_cluster
    from optimus.plan.memory import ModelShape, stage_memory
    from optimus.plan.step_time import step_time

    cluster = load_cluster(cluster_name)
    layout = validate_layout(cluster.resolved(load_config(config_path, overrides)), 1)  # as `optimus plan` prices it
    shape = ModelShape.of(layout.config)
    time_ = step_time(layout.config, layout.dims, shape, cluster, None, layout.batch.micro_batches)
    memory = stage_memory(layout.config, layout.dims, shape, 0)
    return {"step_s": time_.step_s, "parts": time_.parts, "memory_bytes": sum(memory.values()), "memory_terms": memory}


def train(config_path: str, overrides: list[str], warmup: int) -> dict:
    """One short training run on cuda:0: the measured steps after the warm-up, the allocator's peak, the losses."""
    with tempfile.TemporaryDirectory(prefix="optimus-plan-gpu-") as tmp:
        gc.collect()  # the last case's trainer, gone before this one's baseline is read
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        trainer = priced_trainer(config_path, overrides, f"{tmp}/run")
        built = time.perf_counter() - start
        config = trainer.config
        trainer.fit()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
        del trainer
    tokens = config.train.global_batch_size * config.train.seq_len
    steps = [r for r in rows if "tokens_per_s" in r]
    measured = [tokens / r["tokens_per_s"] for r in steps if r["step"] > warmup]
    losses = [r["loss"] for r in steps]
    return {"steps_s": measured, "peak_bytes": peak, "losses": losses, "build_s": built, "wall_s": wall,
            "mfu": [r.get("mfu") for r in steps if r["step"] > warmup]}


def run_case(name: str, cluster: str, steps: int, warmup: int, more: list[str] = ()) -> dict:
    config_path, overrides = case_overrides(name, steps, warmup, more)
    predicted = predict(config_path, overrides, cluster)
    measured = train(config_path, overrides, warmup)
    step = statistics.median(measured["steps_s"])
    gib = 1024**3
    return {"case": name, "overrides": [*CASES[name][1], *more], "cluster": cluster,
            "measured_step_s": step, "measured_steps_s": measured["steps_s"],
            "predicted_step_s": predicted["step_s"], "step_error": predicted["step_s"] / step - 1,
            "predicted_parts_s": predicted["parts"],
            "measured_memory_gib": measured["peak_bytes"] / gib, "predicted_memory_gib": predicted["memory_bytes"] / gib,
            "memory_error": predicted["memory_bytes"] / measured["peak_bytes"] - 1,
            "predicted_memory_terms_gib": {k: v / gib for k, v in predicted["memory_terms"].items()},
            "measured_mfu": statistics.median(m for m in measured["mfu"] if m is not None) if any(measured["mfu"]) else None,
            "losses": measured["losses"], "build_s": measured["build_s"], "wall_s": measured["wall_s"]}


def stored_rows(path: Path = STORED, cluster: str | None = None) -> list[dict]:
    """Every step measured on a GPU (gpu_measured.json) beside what the planner predicts for it now, on the
    cluster each run was measured on (its preset) or on `cluster` (a preset's name or a cluster file, such as a
    node's own calibration: `optimus plan --calibrate --cluster h200 --calibrated-cluster FILE`)."""
    from optimus.plan.cluster import load_cluster

    gib = 1024**3
    rows = []
    device = load_cluster(cluster).device if cluster else ""
    for run in json.loads(Path(path).read_text())["runs"]:
        if device not in run["device"]:  # a cluster file of one device kind prices that kind's runs alone
            continue
        for measured in run["rows"]:
            config_path, overrides = case_overrides(measured["case"], 5, 3, measured["overrides"])
            predicted = predict(config_path, overrides, cluster or run["cluster"])
            rows.append({**measured, "device": run["device"], "cluster": cluster or run["cluster"], "date": run["date"],
                         "predicted_step_s": predicted["step_s"],
                         "step_error": predicted["step_s"] / measured["measured_step_s"] - 1,
                         "predicted_memory_gib": predicted["memory_bytes"] / gib,
                         "memory_error": predicted["memory_bytes"] / gib / measured["measured_memory_gib"] - 1})
    return rows


def print_stored(path: Path, json_path: str, cluster: str | None = None) -> int:
    """The table of stored_rows, its accuracy, and the JSON."""
    from optimus.config import ConfigError
    from optimus.plan.cluster import load_cluster

    if cluster:
        try:
            load_cluster(cluster)
        except ConfigError as error:
            raise SystemExit(f"plan_gpu: --cluster {cluster}: {error}") from None
    try:
        rows = stored_rows(path, cluster)
    except (OSError, ValueError, KeyError, TypeError) as error:  # no file, not JSON, or not runs of measured rows
        raise SystemExit(f"plan_gpu: --stored {path}: not a file of GPU measurements like benchmarks/"
                         f"gpu_measured.json ({type(error).__name__}: {error})") from None
    print(f"steps measured on GPUs ({path}), priced by the planner as it is now "
          f"({'on ' + cluster if cluster else 'presets alone'})")
    print(f"{'device':<22} {'case':<26} {'':<8} {'measured s':>10} {'predicted s':>11} {'error':>7} "
          f"{'meas GiB':>9} {'pred GiB':>9} {'error':>7}")
    for row in rows:
        kind = "compiled" if "--train.compile=true" in row["overrides"] else "eager"
        print(f"{row['device'][:22]:<22} {row['case']:<26} {kind:<8} {row['measured_step_s']:>10.3f} "
              f"{row['predicted_step_s']:>11.3f} {row['step_error']:>+7.1%} {row['measured_memory_gib']:>9.2f} "
              f"{row['predicted_memory_gib']:>9.2f} {row['memory_error']:>+7.1%}")
    print(prediction_accuracy([r["step_error"] for r in rows]))
    write_json(json_path, {"machine": machine_info(), "stored": str(path), "rows": rows})
    print(f"wrote {json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    add_case_arguments(parser, 5, "measured steps after the warm-up", "bench-results/gpu/plan_gpu.json")
    parser.add_argument("--stored", nargs="?", const=str(STORED), default=None, metavar="FILE",
                        help="price the steps measured on GPUs before (default file: benchmarks/gpu_measured.json); "
                             "runs nothing, needs no GPU")
    args = parser.parse_args(argv)
    if args.stored is not None:
        return print_stored(Path(args.stored), args.json, args.cluster)
    device_name, cluster, names = selected_cases(args, "plan_gpu")
    print(f"{device_name}: predicted from the '{cluster}' preset alone (no calibration)")
    print(f"{'case':<26} {'measured s':>10} {'predicted s':>11} {'error':>7} {'meas GiB':>9} {'pred GiB':>9} "
          f"{'error':>7} {'MFU':>6}")
    rows = []
    for name in names:
        try:
            row = run_case(name, cluster, args.steps, args.warmup, args.override)
        except Exception as error:  # noqa: BLE001 - one failing case is reported, the others still run
            print(f"{name:<26} FAILED: {type(error).__name__}: {error}")
            rows.append({"case": name, "error": f"{type(error).__name__}: {error}"})
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        mfu = f"{row['measured_mfu']:.3f}" if row["measured_mfu"] is not None else "-"
        print(f"{name:<26} {row['measured_step_s']:>10.3f} {row['predicted_step_s']:>11.3f} {row['step_error']:>+7.1%} "
              f"{row['measured_memory_gib']:>9.2f} {row['predicted_memory_gib']:>9.2f} {row['memory_error']:>+7.1%} "
              f"{mfu:>6}", flush=True)
    print(prediction_accuracy([r["step_error"] for r in rows if "error" not in r]))
    write_json(args.json, {"machine": machine_info(), "device": device_name, "cluster": cluster, "rows": rows})
    print(f"wrote {args.json}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    run_script(main)
