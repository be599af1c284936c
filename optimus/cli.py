"""The `optimus` command: parse arguments, load the config, call one function per verb.

Bad input (config, data, checkpoint, flags), and a run that cannot go on as configured (too many skipped
steps in a row), end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


class UsageError(ValueError):
    """A command line or run directory that cannot be used, with the fix in the message."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from optimus.checkpoint.manager import CheckpointError
    from optimus.config import ConfigError
    from optimus.data.errors import DataError
    from optimus.models.hf import InteropError
    from optimus.parallel.launch import LaunchError
    from optimus.parallel.mesh import LayoutError
    from optimus.resilience.chaos import ChaosError
    from optimus.resilience.guards import TooManySkippedSteps

    return (ConfigError, DataError, CheckpointError, InteropError, LaunchError, LayoutError, TooManySkippedSteps,
            UsageError, ChaosError)


# ---------------------------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.config import load_config

    config = load_config(args.config, overrides)
    if args.dry_run:
        import yaml

        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        if args.world_size is not None:
            from optimus.parallel.dry_run import dry_run, format_report

            if args.world_size < 1:
                raise UsageError("--world-size must be at least 1")
            print()
            print(format_report(dry_run(config, args.world_size, args.device_memory_gb)))
        return 0
    from optimus.train.trainer import Trainer

    trainer = Trainer(config, progress_bar=not args.no_progress)
    _add_injected_faults(trainer)
    summary = trainer.fit()
    if summary.stopped_by_signal:
        # preempted: the trainer said where it stopped; leave at once, the grace period is short.
        # Exit code 0 (see optimus/resilience/signals.py): the state is saved, nothing failed.
        return 0
    _print_train_summary(trainer, summary, args.config, overrides)
    return 0


def _add_injected_faults(trainer) -> None:
    """Under `optimus chaos`: the steps whose loss the harness wants non-finite (in both of its runs), and
    the file whose appearance makes the next checkpoint write fail as on a full disk."""
    from optimus.resilience.chaos import DISK_FULL_VARIABLE, MIN_STEP_VARIABLE, NAN_STEPS_VARIABLE

    if float(os.environ.get(MIN_STEP_VARIABLE) or 0) > 0:
        from optimus.train.callbacks.fault_injection import PaceSteps

        trainer.callbacks.append(PaceSteps(float(os.environ[MIN_STEP_VARIABLE])))

    if os.environ.get(DISK_FULL_VARIABLE):
        from optimus.train.callbacks.fault_injection import fail_checkpoint_writes_when

        fail_checkpoint_writes_when(Path(os.environ[DISK_FULL_VARIABLE]))

    steps = {int(step) for step in os.environ.get(NAN_STEPS_VARIABLE, "").split(",") if step.strip()}
    if steps:
        from optimus.train.callbacks.fault_injection import NonFiniteAtSteps

        trainer.callbacks.append(NonFiniteAtSteps(trainer.model, steps))


def _print_train_summary(trainer, summary, config_path: str, overrides: list[str]) -> None:
    from optimus.data.sources import load_tokenizer
    from optimus.models.generate import generate

    run = summary.run_dir
    # Every rank takes part in generation (the model may be sharded); only rank 0 prints.
    say = print if trainer.is_rank0 else (lambda *args, **kwargs: None)
    say(f"\nrun directory: {run}")
    if summary.heldout_loss is not None:
        say(f"held-out loss: {summary.heldout_loss:.4f}")
    tokenizer = load_tokenizer(trainer.config.data.tokenizer)
    prompt = "The United States"
    ids = tokenizer.encode(prompt).ids
    import torch

    from optimus.parallel.pipeline import get_pipeline

    if get_pipeline(trainer.model) is None:
        new = generate(trainer.model, torch.tensor([ids], device=trainer.device), max_new_tokens=24)
        say(f"sample: prompt {prompt!r} -> continuation {tokenizer.decode(new[0].tolist())!r} (greedy)")
    else:  # each rank holds only its stages: sample from the checkpoint instead
        say("sample: (pipeline-parallel run: use `optimus generate` below, which loads the whole model)")
    kept = [o for o in overrides if not o.startswith("--train.max_steps")]
    again = " ".join(["optimus train", config_path, *kept])
    say("next:")
    say(f"  resume / extend:  {again} --train.max_steps={summary.step * 2}")
    say(f"  evaluate:         optimus eval {run}")
    say(f"  generate:         optimus generate {run} --prompt 'The Constitution'")
    say(f"  export to HF:     optimus export {run} --format hf --out hf/{run.name}")


# ------------------------------------------------------------------------------ run-dir helpers
def load_run(run_dir: str):
    """(config, model with the newest committed weights) of a run directory."""
    from optimus.checkpoint.manager import CheckpointManager
    from optimus.config import load_config
    from optimus.models.transformer import build_model
    from optimus.train.state import ModelState

    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise UsageError(f"'{run}' is not a run directory (no config.yaml): pass the run.dir of a training run")
    config = load_config(run / "config.yaml")
    manager = CheckpointManager(run)
    step = manager.latest()
    if step is None:
        raise UsageError(f"run '{run}' has no committed checkpoint yet: train it first (optimus train ...)")
    model = build_model(config.model, device="cpu")
    manager.load(step, {"model": ModelState(model)})
    model.eval()
    return config, model


# ---------------------------------------------------------------------------------------- chaos
def cmd_chaos(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.resilience.chaos import FAULT_KINDS, IN_JOB_KINDS, format_report, run_chaos

    if args.faults < 1 or args.ranks < 1:
        raise UsageError("--faults and --ranks must be at least 1")
    kinds = args.kinds.split(",") if args.kinds else [k for k in FAULT_KINDS if args.ranks > 1 or k not in IN_JOB_KINDS]
    out = Path(args.out or f"runs/chaos-{Path(args.config).stem}")
    report = run_chaos(args.config, overrides, out, args.faults, args.ranks, kinds, seed=args.seed,
                       hang_timeout_s=args.hang_timeout, timeout=args.timeout, min_step_s=args.min_step_seconds,
                       env=os.environ)
    print(format_report(report))
    print(f"report: {out / 'report.json'}; logs: {out}/reference.log, {out}/chaos.log")
    return 0 if report.survived else 1


# ------------------------------------------------------------------------------------- tokenize
def cmd_tokenize(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.data.tokenize import tokenize_command

    return tokenize_command(args)


# ----------------------------------------------------------------------------------------- eval
def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from optimus.data.dataset import open_token_dataset
    from optimus.data.loader import heldout_batches
    from optimus.data.sources import load_tokenizer
    from optimus.train.evaluate import evaluate

    if args.tasks:
        return _eval_tasks(args)
    config, model = load_run(args.run)
    seq_len = args.seq_len or config.train.seq_len
    if args.data:
        data = Path(args.data)
        split = "heldout" if data.is_dir() and (data / "heldout.bin").exists() else "train"
        datasets = [open_token_dataset(data, split=split)]
    else:
        from optimus.data.build import build_training_data

        datasets = build_training_data(config).heldout
    batches = heldout_batches(datasets, seq_len, args.batch_size, args.batches)
    if not batches:
        raise UsageError("no evaluation data: pass --data with a tokenized directory or .bin file")
    result = evaluate(model, batches, torch.device("cpu"), "fp32", load_tokenizer(config.data.tokenizer))
    print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.2f}  bits/byte {result.bits_per_byte:.4f}  "
          f"({result.tokens:,} tokens)")
    return 0


def _eval_tasks(args: argparse.Namespace) -> int:
    """`optimus eval RUN --tasks a,b`: downstream accuracies, printed and written to RUN/eval_tasks.json."""
    import json

    import torch

    from optimus.data.sources import load_tokenizer
    from optimus.eval.scoring import evaluate_tasks, format_table
    from optimus.eval.tasks import check_task_names

    names = check_task_names([name for name in args.tasks.split(",") if name])
    if not names:
        raise UsageError("--tasks names no task: pass e.g. --tasks arc_easy,hellaswag")
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1 (or left out for every question)")
    config, model = load_run(args.run)
    results = evaluate_tasks(model, load_tokenizer(config.data.tokenizer), names, torch.device("cpu"),
                             max_len=args.seq_len or config.train.seq_len, limit=args.limit,
                             batch_size=args.batch_size)
    print(format_table(results))
    out = Path(args.run) / "eval_tasks.json"
    out.write_text(json.dumps({name: score.as_record() for name, score in results.items()}, indent=2) + "\n")
    print(f"written: {out}")
    return 0


# ------------------------------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from optimus.data.sources import load_tokenizer, tokenizer_info
    from optimus.models.generate import generate

    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if args.temperature < 0:
        raise UsageError("--temperature must be >= 0 (0 = greedy)")
    config, model = load_run(args.run)
    tokenizer = load_tokenizer(config.data.tokenizer)
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise UsageError("--prompt is empty: give some text to continue")
    generator = torch.Generator().manual_seed(args.seed)
    eos = tokenizer_info(config.data.tokenizer)["eos_id"]
    new = generate(model, torch.tensor([ids]), args.max_new_tokens, args.temperature, eos, generator)
    # the prompt is echoed on its own line, then only the model's continuation (exactly as decoded)
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}, seed {args.seed}"
    print(f"prompt: {args.prompt}")
    print(f"continuation ({new.shape[1]} tokens, {how}): {tokenizer.decode(new[0].tolist())}")
    return 0


# ------------------------------------------------------------------------------- export/import
def cmd_export(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.data.sources import resolve_tokenizer_path, tokenizer_info
    from optimus.models.hf import ExportTokenizer, export_hf

    config, model = load_run(args.run)
    info = tokenizer_info(config.data.tokenizer)
    tokenizer, note = None, " without a tokenizer: the run's tokenizer has more ids than the model's vocabulary"
    if info["vocab_size"] <= config.model.vocab_size:  # e.g. an imported model with its own small vocabulary
        tokenizer = ExportTokenizer(resolve_tokenizer_path(config.data.tokenizer), info["eos_token"], info["pad_token"])
        note = " with its tokenizer"
    out = export_hf(model, config.model, args.out, dense_format=args.dense_format, tokenizer=tokenizer)
    print(f"exported {args.run} to {out} (Hugging Face transformers layout{note})")
    return 0


def cmd_import(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.checkpoint.manager import CheckpointManager
    from optimus.config import build_config, save_config
    from optimus.models.hf import import_hf
    from optimus.models.transformer import build_model
    from optimus.train.state import ModelState

    out = Path(args.out)
    if CheckpointManager(out).latest() is not None:
        raise UsageError(f"'{out}' already holds checkpoints: choose a new --out so nothing is overwritten")
    model_config, state_dict = import_hf(args.hf_dir)
    config = build_config({"model": model_config.model_dump(), "run": {"dir": str(out)}})
    model = build_model(config.model, device="cpu")
    model.load_state_dict(state_dict, strict=True)
    CheckpointManager(out).preflight(checkpoint_bytes=sum(t.numel() * 4 for t in state_dict.values()))
    save_config(config, out / "config.yaml")
    CheckpointManager(out).save(0, {"model": ModelState(model)}, {"model": config.model.model_dump(), "contents": ["model"]})
    print(f"imported {args.hf_dir} into {out} (step 0): continue with optimus train {out}/config.yaml")
    return 0


# --------------------------------------------------------------------------------------- report
def cmd_report(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.report import ReportError, write_report

    try:
        path = write_report(args.run, args.out)
    except ReportError as err:
        raise UsageError(str(err)) from None
    print(f"report: {path}")
    return 0


# --------------------------------------------------------------------------------------- verify
def cmd_verify(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from optimus.checkpoint.preflight import human_bytes
    from optimus.checkpoint.verify import verify_run

    run = Path(args.run)
    if not (run / "checkpoints").is_dir():
        raise UsageError(f"'{run}' holds no checkpoints folder: pass the run.dir of a training run")
    reports = verify_run(run)
    if not reports:
        raise UsageError(f"'{run}/checkpoints' holds no checkpoint yet: train first (optimus train ...)")
    table = Table(title=f"checkpoints of {run}")
    for column in ("checkpoint", "step", "files", "size", "status"):
        table.add_column(column, justify="right" if column in ("step", "files", "size") else "left")
    for report in reports:
        table.add_row(report.name, str(report.step), str(report.files), human_bytes(report.bytes),
                      "ok" if report.ok else report.problem, style=None if report.ok else "bold red")
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    bad = [report.name for report in reports if not report.ok]
    if bad:
        print(f"optimus verify: {len(bad)} of {len(reports)} checkpoints are bad: {', '.join(bad)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


# ----------------------------------------------------------------------------------------- info
def cmd_info(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from optimus.config import ConfigError, load_config
    from optimus.models.flops import count_parameters, flops_per_token
    from optimus.models.presets import PRESETS
    from optimus.models.transformer import build_model

    rows = dict(PRESETS)  # no target: every preset
    highlight = None
    if args.target:
        if args.target in PRESETS:
            rows = {args.target: PRESETS[args.target]}  # only the one asked (each row builds a meta model)
        elif Path(args.target).is_file():
            highlight = "config"
            rows = {"config": load_config(args.target, overrides).model}
        else:
            raise ConfigError(f"unknown preset '{args.target}': choose one of {', '.join(sorted(PRESETS))} or a config file")
    table = Table(title=f"Optimus models (FLOPs per token at sequence length {args.seq_len}, training)")
    for column in ("preset", "kind", "layers", "d_model", "experts", "total params", "active params", "FLOPs/token"):
        table.add_column(column, justify="left" if column in ("preset", "kind") else "right", no_wrap=True)
    for name, config in rows.items():
        model = build_model(config, device="meta")  # no memory is allocated for any preset
        params = count_parameters(model, config)
        kind = f"MoE top-{config.top_k}" if config.is_moe else "dense"
        experts = str(config.n_experts) if config.is_moe else "-"
        table.add_row(
            name, kind, str(config.n_layers), str(config.d_model), experts, _human(params.total), _human(params.active),
            f"{flops_per_token(params, config, args.seq_len) / 1e9:.2f} G", style="bold green" if name == highlight else None,
        )
    # A pipe or a log file has no width: do not let rich squeeze the names to fit 80 columns.
    Console(width=None if sys.stdout.isatty() else 140).print(table)
    return 0


# ----------------------------------------------------------------------------------------- plan
def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.config import load_config
    from optimus.plan.cluster import load_cluster
    from optimus.plan.report import format_table, write_best_config, write_json
    from optimus.plan.search import plan

    if args.calibrate and args.cluster != "here":
        raise UsageError(f"--calibrate measures this machine: use it with --cluster here (not '{args.cluster}')")
    cluster = None if args.cluster == "here" else load_cluster(args.cluster)  # an unknown one fails before the config
    if args.tokens is not None and args.tokens <= 0:
        raise UsageError(f"--tokens must be positive (got {args.tokens:g})")
    if args.top < 1:
        raise UsageError(f"--top must be at least 1 (got {args.top})")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise UsageError(f"--efficiency must be in (0, 1] (got {args.efficiency:g})")
    config = load_config(args.config, overrides)
    if cluster is None:
        cluster = _here_cluster(config, args.devices, args.calibrate, args.config)
    efficiency = cluster.efficiency.with_gemm(args.efficiency) if args.efficiency is not None else None
    candidates = plan(config, cluster, args.devices, efficiency)
    if not candidates:
        raise UsageError(f"no layout of {args.devices} devices passes validate_layout for this config: "
                         f"check train.global_batch_size (it must divide over the data-parallel ranks)")
    print(format_table(candidates, cluster, args.devices, args.top, args.tokens))
    if args.json:
        write_json(args.json, candidates, cluster, args.tokens)
    best = candidates[0]
    if not best.fits:
        print(f"no layout fits {cluster.memory_gb:g} GiB devices: more devices, or a smaller model or batch")
    elif args.write_config:
        write_best_config(args.write_config, best, config)
        print(f"best layout written to {args.write_config}")
    return 0


def here_cache_files() -> tuple[Path, tuple[Path, str]]:
    """(the `here` planner cache, the CPU-speed cache and its kernel key): per host, under XDG_CACHE_HOME."""
    from optimus.parallel.launch import cpu_speed_cache

    cpu_file, kernel_env = cpu_speed_cache()
    return cpu_file.parent / "plan_here.json", (cpu_file, kernel_env)


def _here_cluster(config, devices: int, calibrate: bool, config_path: str):
    """The measured `here` cluster for `devices` ranks; with `calibrate`, measure everything again first."""
    from optimus.parallel.validate import validate_layout
    from optimus.plan.calibrate import calibrate_op_classes, describe
    from optimus.plan.here import here_cluster, machine, write_cache

    cache_file, cpu_cache = here_cache_files()
    if devices < 1:
        raise UsageError(f"--devices must be at least 1 (got {devices})")
    if calibrate:
        print(f"calibrating here (matmul peaks, copy bandwidth, gloo collectives on 2 and 4 ranks, op classes "
              f"at {config_path}'s shapes): about a minute", flush=True)
    entry = machine(cache_file, cpu_cache, remeasure=calibrate)
    if calibrate:
        # the micro-batch the op classes are timed at: the configured layout's (one rank when none is set)
        resolved = validate_layout(config).config
        entry.update(calibrate_op_classes(resolved, entry))
        entry["calibrated_for"] = (f"{Path(config_path).name}: {resolved.train.micro_batch_size} x "
                                   f"{resolved.train.seq_len} tokens")
        write_cache(cache_file, entry)
        print("\n".join(describe(entry)))
        print(f"stored in {cache_file}; later `optimus plan ... --cluster here` runs use it")
    elif "efficiency" not in entry:
        print("here: op-class efficiencies are CPU defaults, not measured: run `optimus plan CONFIG --cluster here "
              "--devices N --calibrate` once", file=sys.stderr)
    return here_cluster(entry, devices)


def cmd_tune(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.config import load_config
    from optimus.plan.report import write_best_config
    from optimus.plan.tune import format_trials, tune

    for flag, value in (("--trials", args.trials), ("--ranks", args.ranks), ("--steps", args.steps)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value})")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be at least 0 (got {args.warmup})")
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise UsageError("optimus tune needs optuna: pip install 'optimus[tune]' (or pip install optuna)") from None
    config = load_config(args.config, overrides)
    cluster = _here_cluster(config, args.ranks, calibrate=False, config_path=args.config)
    out_dir = Path(args.out)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    best, records = tune(config, args.config, overrides, cluster, args.ranks, args.trials, out_dir, env,
                         steps=args.steps, warmup=args.warmup, seed=args.seed)
    print(format_trials(records))
    print(f"every trial: {out_dir / 'trials.jsonl'}")
    if best is None:
        print("no trial ran to the end: see the status column", file=sys.stderr)
        return 1
    path = out_dir / "best.yaml"
    write_best_config(path, best, config)
    print(f"best measured layout written to {path}")
    return 0


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# --------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="optimus", description="Pretrain dense and MoE language models.")
    verbs = parser.add_subparsers(dest="verb", required=True)

    train = verbs.add_parser("train", help="train (or resume) a run from a YAML config; --section.key=value overrides")
    train.add_argument("config", help="YAML config, e.g. configs/mula-tiny-moe.yaml")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    train.add_argument("--world-size", type=int, default=None,
                       help="with --dry-run: also apply the layout for a job of N ranks (meta device, fake process "
                            "group) and print each rank's memory")
    train.add_argument("--device-memory-gb", type=float, default=64.0,
                       help="with --dry-run --world-size: device memory to compare against (default 64)")
    train.add_argument("--no-progress", action="store_true", help="no live progress bar")
    train.set_defaults(func=cmd_train, takes_overrides=True)

    chaos = verbs.add_parser("chaos", help="train a config undisturbed and again under injected faults; compare")
    chaos.add_argument("config", help="YAML config (overrides --section.key=value apply to both runs)")
    chaos.add_argument("--faults", type=int, default=10, help="how many faults to inject (default 10)")
    chaos.add_argument("--ranks", type=int, default=2, help="processes per run, under torchrun when > 1 (default 2)")
    chaos.add_argument("--kinds", help="comma list of fault kinds (default: all that the rank count allows)")
    chaos.add_argument("--seed", type=int, default=0, help="draws the faults' kinds, steps and victims")
    chaos.add_argument("--hang-timeout", type=float, default=20.0, help="watchdog timeout for hang_rank (s)")
    chaos.add_argument("--timeout", type=float, default=600.0, help="longest wait for any one stage (s)")
    chaos.add_argument("--out", help="output folder (default runs/chaos-CONFIG)")
    chaos.add_argument("--min-step-seconds", type=float, default=0.0,
                       help="make every step last at least this long (tiny test models), in both runs")
    chaos.set_defaults(func=cmd_chaos, takes_overrides=True)

    tokenize = verbs.add_parser("tokenize", help="turn txt/jsonl[.gz|.zst]/parquet into token memmaps")
    from optimus.data.tokenize import add_tokenize_arguments

    add_tokenize_arguments(tokenize)
    tokenize.set_defaults(func=cmd_tokenize)

    ev = verbs.add_parser("eval", help="held-out loss, perplexity and bits per byte of a run")
    ev.add_argument("run")
    ev.add_argument("--data", help="tokenized directory or .bin file (default: the run's own held-out split)")
    ev.add_argument("--batches", type=int, default=16)
    ev.add_argument("--batch-size", type=int, default=4)
    ev.add_argument("--seq-len", type=int, default=None)
    ev.add_argument("--tasks", help="downstream tasks instead of held-out loss, comma-separated (e.g. arc_easy,"
                                    "hellaswag): log-likelihood ranking, written to RUN/eval_tasks.json")
    ev.add_argument("--limit", type=int, default=None, help="with --tasks: the first N questions of each task")
    ev.set_defaults(func=cmd_eval)

    gen = verbs.add_parser("generate", help="continue a prompt with a trained run")
    gen.add_argument("run")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_generate)

    export = verbs.add_parser("export", help="write a run's weights in another format")
    export.add_argument("run")
    export.add_argument("--format", choices=["hf"], required=True)
    export.add_argument("--out", required=True)
    export.add_argument("--dense-format", choices=["auto", "olmo2", "llama"], default="auto",
                        help="dense models: OLMo-2 (post-norm, QK-norm) or Llama (pre-norm, no QK-norm)")
    export.set_defaults(func=cmd_export)

    imp = verbs.add_parser("import", help="turn a Hugging Face OLMoE / OLMo-2 / Llama directory into a run")
    imp.add_argument("hf_dir")
    imp.add_argument("--out", required=True)
    imp.set_defaults(func=cmd_import)

    report = verbs.add_parser("report", help="one HTML page of a run's curves (loss, throughput, MFU, expert load, "
                                             "memory, checkpoints...), written at the end of every run too")
    report.add_argument("run")
    report.add_argument("--out", default=None, help="the HTML file to write (default RUN/report.html)")
    report.set_defaults(func=cmd_report)

    verify = verbs.add_parser("verify", help="check every checkpoint of a run (sizes, hashes, index); exit 2 if any is bad")
    verify.add_argument("run")
    verify.set_defaults(func=cmd_verify)

    info = verbs.add_parser("info", help="parameters and FLOPs per token of the presets (or of a config)")
    info.add_argument("target", nargs="?", help="a preset name or a config file")
    info.add_argument("--seq-len", type=int, default=4096)
    info.set_defaults(func=cmd_info, takes_overrides=True)

    plan = verbs.add_parser("plan", help="predict memory, step time, MFU and energy of every valid layout on a cluster; "
                                         "rank them")
    plan.add_argument("config", help="YAML config (any model: a preset via --model.preset=NAME, or a config file)")
    plan.add_argument("--cluster", required=True,
                      help="cluster preset: aurora, frontier, lumi, h100, h200, a100, or here (this machine, measured)")
    plan.add_argument("--calibrate", action="store_true",
                      help="with --cluster here: time matmuls, memory-bound ops, operator overhead and gloo "
                           "collectives at this config's shapes, store the fit for later runs, print it")
    plan.add_argument("--devices", type=int, required=True, help="devices (GPU tiles / GCDs) of the job: whole nodes")
    plan.add_argument("--tokens", type=float, default=None, help="token budget: also print days, MWh and tCO2e")
    plan.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    plan.add_argument("--json", default=None, help="write every layout, ranked, to this JSON file")
    plan.add_argument("--write-config", default=None, help="write the best fitting layout as a config file")
    plan.add_argument("--efficiency", type=float, default=None,
                      help="fraction of peak FLOP/s every compute op class reaches (default: the cluster preset's "
                           "efficiency block)")
    plan.set_defaults(func=cmd_plan, takes_overrides=True)

    tune_ = verbs.add_parser("tune", help="measured layout search here: short real runs of the planner's feasible "
                                          "layouts, chosen by optuna; every trial recorded, the best written as a config")
    tune_.add_argument("config", help="YAML config (overrides as for train)")
    tune_.add_argument("--trials", type=int, required=True, help="layouts to run")
    tune_.add_argument("--ranks", type=int, default=1, help="processes per trial (gloo on this machine; default 1)")
    tune_.add_argument("--steps", type=int, default=2, help="measured steps per trial, after the warm-up (default 2)")
    tune_.add_argument("--warmup", type=int, default=1, help="steps not measured (default 1)")
    tune_.add_argument("--seed", type=int, default=0, help="optuna sampler seed")
    tune_.add_argument("--out", default="runs/tune", help="where trials.jsonl and best.yaml go (default runs/tune)")
    tune_.set_defaults(func=cmd_tune, takes_overrides=True)

    verbs.add_parser("launch", help="torchrun's options, then an optimus command: runs the ranks under torchrun "
                                    "and ends a bad-input error with one line and exit code 2",
                     usage="optimus launch [torchrun options] VERB ...")
    return parser


_VERBS = ("train", "tokenize", "eval", "generate", "export", "import", "info")


def _report_user_error(line: str) -> None:
    """Bad input ends the job with `line` once: on rank 0 only (every rank usually meets the same error).

    Under torchrun the line also goes to the worker's error file, so torchrun's failure summary names
    it and `optimus launch` prints it last. Other ranks wait a moment first: torchrun stops every
    worker as soon as one exits, and rank 0 should have said why by then (a rank that alone meets
    the error still records it after the wait).
    """
    import json
    import os
    import time

    from optimus.parallel.launch import LaunchError, detect_launch_env
    from optimus.parallel.torchrun import WORKER_ERRORS_ENV, WORKER_ERRORS_TO_LAUNCHER

    try:
        rank = detect_launch_env().rank
    except (LaunchError, ValueError):
        rank = 0
    if rank != 0:  # a rank stopped meanwhile by torchrun leaves no record: rank 0's is the root cause
        time.sleep(_QUIET_RANK_DELAY_S)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
        try:
            Path(error_file).write_text(json.dumps({"message": record}))
        except OSError:
            pass  # the line is still printed below
    if rank == 0 and os.environ.get(WORKER_ERRORS_ENV) != WORKER_ERRORS_TO_LAUNCHER:
        print(line, file=sys.stderr, flush=True)


_QUIET_RANK_DELAY_S = 3.0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `optimus` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # torchrun's options pass through untouched: no argparse here
        from optimus.parallel.torchrun import run_torchrun

        try:
            return run_torchrun(argv[1:], _VERBS)
        except ValueError as err:
            print(f"optimus launch: error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.func(args, extra)
    except _user_errors() as err:
        _report_user_error(f"optimus {args.verb}: error: {err}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"optimus {args.verb}: interrupted", file=sys.stderr)
        return 130
    from optimus.parallel.launch import leave_distributed

    return leave_distributed(code)


if __name__ == "__main__":
    sys.exit(main())
