"""`optimus plan` (predict and rank layouts on a cluster; `--calibrate` measures this machine) and `optimus tune`."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from optimus.cli.errors import UsageError, output_location

if TYPE_CHECKING:  # the CLI imports torch only for the command it runs
    from optimus.plan.routing import Routing


# how token budgets are spoken of: OLMoE's 5T, a 100B-token run
TOKEN_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def token_count(text: str) -> float:
    """`--tokens`: a number (100e9) or one with a K, M, B (or G) or T suffix (100B, 2.5T)."""
    value = text.strip()
    scale = TOKEN_SUFFIXES.get(value[-1:].lower(), 1.0)
    number = value[:-1] if scale != 1.0 else value
    try:
        return float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens: give e.g. 100e9 or 100B "
                                         "(suffixes K, M, B, T)") from None


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.plan.cluster import load_cluster
    from optimus.plan.report import (describe_routing, describe_scaling, format_table, write_best_config,
                                     write_json)
    from optimus.plan.routing import LoggedRouting
    from optimus.plan.scaling import smaller_config, smaller_run
    from optimus.plan.search import parse_only, plan

    only = parse_only(args.only or [])
    cluster = None if args.cluster == "here" else load_cluster(args.cluster)  # an unknown one fails before the config
    calibrated_file = _calibrated_cluster_file(args, cluster)
    if args.tokens is not None and not 0 < args.tokens < math.inf:
        raise UsageError(f"--tokens must be a positive number of tokens (got {args.tokens:g})")
    if args.top < 1:
        raise UsageError(f"--top must be at least 1 (got {args.top})")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise UsageError(f"--efficiency must be in (0, 1] (got {args.efficiency:g})")
    if not 1 <= args.moe_imbalance < math.inf:
        raise UsageError(f"--moe-imbalance is the busiest rank's token copies over its balanced share: a number of "
                         f"at least 1 (got {args.moe_imbalance:g})")
    if args.scaling is not None and args.scaling_from is None:
        raise UsageError(f"--scaling {args.scaling} says how to scale from a smaller run: give its devices with "
                         f"--scaling-from M")
    if args.scaling_from is not None and cluster is not None and args.devices <= cluster.devices_per_node:
        # the smaller run is whole nodes (below): one node has none smaller, so name what does work
        per_node = cluster.devices_per_node
        raise UsageError(f"--scaling-from compares whole {cluster.name} nodes: --devices {args.devices} is at most "
                         f"one node of {per_node}; plan at least 2 nodes ({2 * per_node} devices) or drop "
                         "--scaling-from")
    if args.moe_routing is not None and args.moe_imbalance != 1:
        raise UsageError("--moe-routing and --moe-imbalance both price the routing: give one (the run's logged "
                         "routing, or one figure for every layout)")
    check_plan_outputs(args)
    config = _config_to_plan(args.config, overrides)
    if args.moe_imbalance != 1 and not config.model.is_moe:
        raise UsageError(f"--moe-imbalance prices an MoE's routing: this config's model is dense (model.n_experts "
                         f"is 0); drop the flag")
    routing: Routing = args.moe_imbalance
    if args.moe_routing is not None:
        routing = LoggedRouting.read(args.moe_routing)
        routing.check_model(config)
    scaling = args.scaling or "strong"
    if args.scaling_from is not None:
        smaller_config(config, args.devices, args.scaling_from, scaling)  # a batch the smaller run cannot split
    if cluster is None:
        cluster = _here_cluster(config, args.devices, args.calibrate, args.config)
    elif calibrated_file is not None:
        cluster = _calibrate_node(config, cluster, calibrated_file, args)
    # (`here` is one machine whatever its ranks: fewer of them are the smaller run)
    if args.scaling_from is not None and args.cluster != "here" and args.scaling_from % cluster.devices_per_node:
        raise UsageError(f"--scaling-from {args.scaling_from} is not a multiple of the {cluster.devices_per_node} "
                         f"devices per {cluster.name} node: compare whole nodes")
    efficiency = cluster.efficiency.with_gemm(args.efficiency) if args.efficiency is not None else None
    candidates = plan(config, cluster, args.devices, efficiency, only, routing)
    if not candidates and only:
        raise UsageError(f"no layout of {args.devices} devices within --only {' '.join(args.only)} passes "
                         f"validate_layout for this config: allow more values, or check train.global_batch_size")
    if not candidates:
        raise UsageError(f"no layout of {args.devices} devices passes validate_layout for this config: "
                         f"check train.global_batch_size (it must divide over the data-parallel ranks)")
    if args.moe_imbalance != 1:
        print(f"priced for MoE routing that sends the busiest expert-holding rank {args.moe_imbalance:g}x its "
              f"balanced share of token copies (--moe-imbalance)")
    if isinstance(routing, LoggedRouting):
        print(describe_routing(routing, candidates[0]))
    if only:
        print(f"searched only layouts with {'; '.join(f'{k} in {{{sorted_values(v)}}}' for k, v in only.items())}")
    print(format_table(candidates, cluster, args.devices, args.top, args.tokens))
    best = candidates[0]
    baseline = None
    if args.scaling_from is not None:
        smaller_cluster = cluster if args.cluster != "here" else _here_cluster(config, args.scaling_from, False,
                                                                              args.config, quiet=True)
        baseline = smaller_run(config, smaller_cluster, args.devices, args.scaling_from, scaling, efficiency, only,
                               routing)
        print(describe_scaling(baseline, best, args.devices))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, candidates, cluster, args.tokens, args.devices, baseline)
    if best.fits and not config.train.compile and not cluster.host_cpu:  # measured on a GPU only
        hint_setting(best, cluster, efficiency, routing, section="train", field="compile", value=True,
                     min_speedup=1.1,
                     why="compiled blocks fuse the eager norms, RoPE and activations and launch fewer kernels")
    if best.fits and config.parallel.grad_reduce_dtype == "fp32" and best.dims().dp > 1:
        hint_setting(best, cluster, efficiency, routing, section="parallel", field="grad_reduce_dtype",
                     value="bf16",
                     min_speedup=1.05,
                     why="its gradients cross the data-parallel ranks in half the bytes, each sum rounded to bf16")
    if not best.fits:
        print(f"no layout fits {cluster.memory_label} devices: more devices, or a smaller model or batch")
    elif args.write_config:
        Path(args.write_config).parent.mkdir(parents=True, exist_ok=True)
        write_best_config(args.write_config, best, config)
        print(f"best layout written to {args.write_config}")
    return 0


def check_plan_outputs(args: argparse.Namespace) -> None:
    """--json and --write-config, before the (possibly long) search: writable places, two different files, never the
    config being planned (a resolved layout or a JSON list in place of the user's own file, comments and all, even
    with --overwrite), and no other existing file replaced without --overwrite."""
    outputs = [(flag, path) for flag, path in (("--json", args.json), ("--write-config", args.write_config)) if path]
    for flag, path in outputs:
        output_location(flag, path)
        if args.config and Path(path).resolve() == Path(args.config).resolve():
            raise UsageError(f"{flag} {path} is the config being planned: write to another file")
    if len(outputs) == 2 and Path(args.json).resolve() == Path(args.write_config).resolve():
        raise UsageError(f"--json and --write-config both name {args.json}: give each its own file")
    if args.overwrite:
        return
    for flag, path in outputs:
        if Path(path).exists():
            raise UsageError(f"{flag} {path} already exists: choose another file, or pass --overwrite to replace it")


def _calibrated_cluster_file(args: argparse.Namespace, cluster) -> Path | None:
    """Where --calibrate on a GPU cluster writes its file (checked before anything is measured), or None."""
    if args.calibrated_cluster and not (args.calibrate and cluster is not None):
        raise UsageError("--calibrated-cluster names the file --calibrate writes on a GPU node: give --calibrate and a "
                         "GPU cluster with it (--cluster here keeps its calibration in its own cache)")
    if not args.calibrate or cluster is None:
        return None
    path = args.calibrated_cluster or f"{cluster.name}-calibrated.yaml"
    output_location("--calibrated-cluster", path)
    if Path(path).exists() and not args.overwrite:
        raise UsageError(f"--calibrated-cluster {path} already exists: choose another file, or pass --overwrite to "
                         "replace it")
    return Path(path)


def _calibrate_node(config, cluster, path: Path, args: argparse.Namespace):
    """Measure this node's accelerators for `cluster` (plan/calibrate_node.py), write the cluster file, print what
    changed, and return the cluster as read back from the file."""
    from optimus.parallel.local_ranks import LocalRanksError
    from optimus.parallel.validate import validate_layout
    from optimus.plan.calibrate_node import (calibrated_cluster_text, check_devices, describe_node, measure_node,
                                             write_calibrated)
    from optimus.plan.cluster import load_cluster
    from optimus.train.hardware import probe_local_accelerators

    found = probe_local_accelerators()
    check_devices(cluster, found, args.cluster)
    config = validate_layout(config).config  # the micro-batch timed: the configured layout's (one rank when none)
    what = f"{Path(args.config).name}: {config.train.micro_batch_size} x {config.train.seq_len} tokens a micro-batch"
    print(f"calibrating {cluster.name} on this node's {found.count} {found.name} (op classes at {what}; "
          f"collectives over {min(found.count, cluster.devices_per_node)} devices): a few minutes", flush=True)
    try:
        measured = measure_node(config, cluster, found)
    except LocalRanksError as err:  # out of device memory at these shapes, a broken NCCL: what the rank said last
        last = str(err).strip().splitlines()[-1]
        raise UsageError(f"calibrating {cluster.name} on this node failed ({str(err).splitlines()[0].rstrip(':')}: "
                         f"{last}); nothing was written") from None
    write_calibrated(path, calibrated_cluster_text(cluster, measured, found, what))
    print("\n".join(describe_node(cluster, measured)))
    # one H200's kernels ran Mula-7B-A1B's projections at 0.60 of peak and its experts at 0.28 at 1 x 2,048 tokens,
    # at 0.70 and 0.48 at 4 x 2,048 (BENCHMARKS.md, stop 58): one micro-batch's rates do not hold for all
    table = measured["efficiency"].get("by_rows") or {}
    timed = sorted({round(float(rows) / config.train.seq_len) for rows in table.get("dense_gemm", {})})
    if len(timed) > 1:
        print(f"note: the compute classes timed at {', '.join(map(str, timed))} x {config.train.seq_len} tokens a "
              "micro-batch; each layout is priced at its own micro-batch's rows (between those, and at the nearest "
              "beyond them); the other classes at the configured micro-batch")
    else:
        print(f"note: timed at {config.train.micro_batch_size} x {config.train.seq_len} tokens a micro-batch only (no "
              "larger one fit); layouts at other micro-batches are priced at these rates")
    print(f"calibration written to {path}: plan on it with --cluster {path}")
    return load_cluster(str(path))


def sorted_values(values: frozenset[str]) -> str:
    """A restriction's values, numbers in numeric order."""
    return ", ".join(sorted(values, key=lambda v: (not v.isdigit(), int(v) if v.isdigit() else 0, v)))


# the layout degrees, reset: the plan chooses them (optimus.plan.search enumerates every layout)
RESET_DEGREES = [f"--parallel.{dim}=1" for dim in ("dp_replicate", "dp_shard", "tp", "pp", "ep")]


def _config_to_plan(path: str, overrides: list[str]):
    """The config as written, or, when its own layout does not hold with the overrides (a global batch its
    data-parallel ranks do not divide: 3,072 ranks, --train.global_batch_size=384 for 384 devices), the same with
    the layout degrees reset, since the plan chooses them; a config that is wrong otherwise fails as written."""
    from optimus.config import ConfigError, load_config

    try:
        return load_config(path, overrides)
    except ConfigError as err:
        try:
            config = load_config(path, [*RESET_DEGREES, *overrides])
        except ConfigError:
            raise err from None
        print(f"note: the config's own layout does not hold ({err}); planning every layout from its other settings",
              file=sys.stderr)
        return config


def hint_setting(best, cluster, efficiency, routing: Routing, *, section: str, field: str, value,
                 min_speedup: float, why: str) -> None:
    """Say what setting config.<section>.<field> to `value` would give the best layout, where the planner prices it
    at least `min_speedup` times faster (train.compile: a tenth or more; bf16 gradient reduction: a twentieth)."""
    from optimus.parallel.validate import resolve_batch
    from optimus.plan.memory import ModelShape
    from optimus.plan.routing import layout_imbalance
    from optimus.plan.step_time import step_time

    changed = getattr(best.config, section).model_copy(update={field: value})
    config = best.config.model_copy(update={section: changed})
    dims = best.dims()
    micro_batches = resolve_batch(config.train, dims, config.parallel.pp_schedule).micro_batches
    faster = step_time(config, dims, ModelShape.of(config), cluster, efficiency, micro_batches,
                       layout_imbalance(routing, config, dims)[1]).step_s
    if faster < best.step_s / min_speedup:
        flag = f"--{section}.{field}={str(value).lower()}"
        print(f"with {flag} the best layout is predicted {faster:.3f} s a step ({best.step_s / faster:.2f}x faster): "
              f"{why}")


def here_cache_files() -> tuple[Path, tuple[Path, str]]:
    """(the `here` planner cache, the CPU-speed cache and its kernel key): per host, under XDG_CACHE_HOME."""
    from optimus.parallel.launch import cpu_speed_cache

    cpu_file, kernel_env = cpu_speed_cache()
    return cpu_file.parent / "plan_here.json", (cpu_file, kernel_env)


def _here_cluster(config, devices: int, calibrate: bool, config_path: str, environ: dict[str, str] | None = None,
                  quiet: bool = False):
    """The measured `here` cluster for `devices` ranks, each with the threads the job's environment `environ` (this
    process's by default) gives it; with `calibrate`, measure everything again first; `quiet`: without the notes
    on what the cache lacks (said once, for the planned job)."""
    from optimus.parallel.validate import validate_layout
    from optimus.plan.calibrate import calibrate_op_classes, describe
    from optimus.plan.here import busy_note, here_cluster, machine, rank_threads, threads_phrase, write_cache

    cache_file, cpu_cache = here_cache_files()
    if devices < 1:
        raise UsageError(f"--devices must be at least 1 (got {devices})")
    threads = rank_threads(devices, environ)
    if calibrate:
        print(f"calibrating here (matmul peaks, copy bandwidth, gloo collectives on 2, 3 and 4 ranks, op classes "
              f"at {config_path}'s shapes on {threads_phrase(threads)} a rank): a few minutes", flush=True)
    entry = machine(cache_file, cpu_cache, remeasure=calibrate)
    measured = entry["machine"]
    busy = busy_note(measured.get("load_at_measure"), measured["cores"],
                     "just now, when this calibration began" if calibrate else f"when it was measured "
                     f"({measured['measured_at']})")
    if busy and not quiet:
        print(busy, file=sys.stderr)
    if calibrate:
        # the micro-batch the op classes are timed at: the configured layout's (one rank when none is set)
        resolved = validate_layout(config).config
        entry.update(calibrate_op_classes(resolved, entry, threads))
        entry["calibrated_for"] = (f"{Path(config_path).name}: {resolved.train.micro_batch_size} x "
                                   f"{resolved.train.seq_len} tokens")
        write_cache(cache_file, entry)
        print("\n".join(describe(entry)))
        print(f"stored in {cache_file}; later `optimus plan ... --cluster here` runs use it")
    elif quiet:
        pass
    elif "efficiency" not in entry:
        print("here: op-class efficiencies are CPU defaults, not measured: run `optimus plan CONFIG --cluster here "
              "--devices N --calibrate` once", file=sys.stderr)
    elif entry.get("calibrated_threads", 1) != min(threads, entry["machine"]["cores"]):
        calibrated = entry.get("calibrated_threads", 1)
        print(f"here: the op classes were calibrated on {threads_phrase(calibrated)} a rank and this job's ranks run "
              f"{threads} (OMP_NUM_THREADS, or else torch's default for {devices} rank(s)): `optimus plan CONFIG "
              f"--cluster here --devices {devices} --calibrate` times them so", file=sys.stderr)
    return here_cluster(entry, devices, threads)


def _warn_if_oversubscribed(ranks: int) -> None:
    """More ranks than cores run, but each trial then times the cores' sharing as much as the layout."""
    from optimus.plan.here import cores

    available = cores()
    if ranks > available:
        print(f"warning: --ranks {ranks} on {available} cores: the ranks take turns on the cores, so each trial "
              "measures that sharing as much as its layout (`optimus plan --cluster here` prices it)", file=sys.stderr)


def _launcher(command: str | None) -> list[str] | None:
    """--launcher as the words that start a trial's ranks; UsageError where it is empty or its program is not here."""
    if command is None:
        return None
    import shlex
    import shutil

    try:
        words = shlex.split(command)
    except ValueError as err:
        raise UsageError(f"--launcher {command!r} is not a command line ({err}): quote it as the shell would") from None
    if not words:
        raise UsageError("--launcher is empty: give the command that starts the ranks ('srun -N 2 "
                         "--ntasks-per-node 8'), or leave it out to launch on this node")
    if shutil.which(words[0]) is None:
        raise UsageError(f"--launcher {command!r}: '{words[0]}' is not a program on PATH: run the search where it is "
                         "(inside the allocation), or give its full path")
    return words


def cmd_tune(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.config import load_config
    from optimus.plan.cluster import load_cluster
    from optimus.plan.report import write_best_config
    from optimus.plan.search import parse_only
    from optimus.plan.tune import check_tune_out, format_trials, launcher_ranks, trial_cluster, tune
    from optimus.train.hardware import probe_local_accelerators

    only = parse_only(args.only or [])
    for flag, value in (("--trials", args.trials), ("--ranks", args.ranks), ("--steps", args.steps)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value})")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be at least 0 (got {args.warmup})")
    if not 0 < args.trial_timeout < math.inf:
        raise UsageError(f"--trial-timeout must be a positive number of seconds (got {args.trial_timeout:g})")
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise UsageError("optimus tune needs optuna: pip install 'optimus[tune]' (or pip install optuna)") from None
    out_dir = output_location("--out", args.out, folder=True)
    check_tune_out(out_dir, args.overwrite)  # before the trials: minutes to hours of them
    launcher = _launcher(args.launcher)
    if launcher and (started := launcher_ranks(launcher)) not in (None, args.ranks):
        raise UsageError(f"--launcher {args.launcher!r} starts {started} ranks but --ranks is {args.ranks}: give "
                         f"--ranks {started} (each trial's layout and prices are for that many devices), or a "
                         f"launcher that starts {args.ranks}")
    if args.cluster not in (None, "here"):
        load_cluster(args.cluster)  # an unknown name or a bad file fails before the config
    config = load_config(args.config, overrides)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))  # the trials' ranks' threads
    try:
        found = probe_local_accelerators()
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        raise UsageError(f"{err}: check the driver (nvidia-smi, rocm-smi, xpu-smi) before tuning") from None
    cluster = trial_cluster(args.cluster, args.ranks, found, launcher=launcher is not None)
    if cluster is None:
        _warn_if_oversubscribed(args.ranks)
        cluster = _here_cluster(config, args.ranks, calibrate=False, config_path=args.config, environ=env)
    else:
        where = (f"{args.ranks} of this machine's {found.count} {found.name}" if found and args.ranks <= found.count
                 else f"{args.ranks} devices the launcher starts ranks on")
        print(f"the trials train on {where}, priced and pruned as the {cluster.name} cluster's devices with "
              f"{cluster.memory_label} each, {cluster.devices_per_node} a node")
    best, records = tune(config, args.config, overrides, cluster, args.ranks, args.trials, out_dir, env,
                         steps=args.steps, warmup=args.warmup, seed=args.seed, only=only,
                         overwrite=args.overwrite, launcher=launcher, timeout_s=args.trial_timeout)
    print(format_trials(records))
    print(f"every trial: {out_dir / 'trials.jsonl'}")
    if best is None:
        print("no trial ran to the end: see the status column", file=sys.stderr)
        return 1
    path = out_dir / "best.yaml"
    write_best_config(path, best, config)
    print(f"best measured layout written to {path}")
    return 0
