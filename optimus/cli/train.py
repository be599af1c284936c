"""`optimus train`, `optimus chaos` (train under injected faults) and `optimus tokenize` (data for training)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from optimus.cli.errors import UsageError, output_location


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.config import load_config

    if args.world_size is not None and not args.dry_run:  # it sizes the dry run only: the launcher sets the ranks
        raise UsageError(f"--world-size {args.world_size} applies with --dry-run only: add --dry-run, or start "
                         f"{args.world_size} ranks with `optimus launch --nproc-per-node {args.world_size} train ...`")
    config = load_config(args.config, overrides)
    if args.dry_run:
        import yaml

        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        if args.world_size is not None:
            from optimus.parallel.dry_run import dry_run, format_report

            if args.world_size < 1:
                raise UsageError("--world-size must be at least 1")
            if not 0 < args.device_memory_gb < float("inf"):  # nan and -1 would print every layout as not fitting
                raise UsageError(f"--device-memory-gb must be a positive number of GiB (got {args.device_memory_gb:g})")
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
    again = " ".join([_relaunch_prefix(), "train", config_path, *kept])
    say("next:")
    say(f"  resume / extend:  {again} --train.max_steps={summary.step * 2}")
    say(f"  evaluate:         optimus eval {run}")
    say(f"  generate:         optimus generate {run} --prompt 'The Constitution'")
    say(f"  export to HF:     optimus export {run} --format hf --out hf/{run.name}")


def _relaunch_prefix() -> str:
    """How to start this job again: `optimus` for one process; several ranks need their launcher again."""
    from optimus.parallel.launch import detect_launch_env

    launch = detect_launch_env()
    if launch.world_size == 1:
        return "optimus"
    nodes = launch.world_size // max(launch.local_world_size, 1)
    if launch.launcher == "torchrun" and nodes == 1:
        return f"optimus launch --nproc-per-node {launch.local_world_size}"
    return f"[{launch.world_size} ranks through {launch.launcher}, as this job was started] optimus"


def cmd_chaos(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.resilience.chaos import FAULT_KINDS, IN_JOB_KINDS, format_report, run_chaos

    if args.faults < 1 or args.ranks < 1:
        raise UsageError("--faults and --ranks must be at least 1")
    for flag, seconds in (("--hang-timeout", args.hang_timeout), ("--timeout", args.timeout)):
        if not 0 < seconds < float("inf"):
            raise UsageError(f"{flag} must be a positive number of seconds (got {seconds:g})")
    if not 0 <= args.min_step_seconds < float("inf"):
        raise UsageError(f"--min-step-seconds must be >= 0 (got {args.min_step_seconds:g})")
    kinds = args.kinds.split(",") if args.kinds else [k for k in FAULT_KINDS if args.ranks > 1 or k not in IN_JOB_KINDS]
    out = output_location("--out", args.out or f"runs/chaos-{Path(args.config).stem}", folder=True)
    report = run_chaos(args.config, overrides, out, args.faults, args.ranks, kinds, seed=args.seed,
                       hang_timeout_s=args.hang_timeout, timeout=args.timeout, min_step_s=args.min_step_seconds,
                       env=os.environ)
    print(format_report(report))
    print(f"report: {out / 'report.json'}; logs: {out}/reference.log, {out}/chaos.log")
    return 0 if report.survived else 1


def cmd_tokenize(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.data.tokenize import tokenize_command

    output_location("--output", args.output, folder=True)
    output = Path(args.output)
    created = not output.exists()
    try:
        return tokenize_command(args)
    except BaseException:
        if created and output.is_dir() and not any(output.iterdir()):
            output.rmdir()  # a failed first tokenization leaves no empty folder behind that looks like its result
        raise
