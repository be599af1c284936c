"""The verbs that take a run directory: eval, generate, export, report, verify; and import, which makes one."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from optimus.cli.errors import EXIT_BAD_INPUT, UsageError, output_location


def load_run(run_dir: str):
    """(config, model with the newest committed weights) of a run directory."""
    from optimus.checkpoint.manager import CheckpointManager
    from optimus.config import load_config
    from optimus.models.transformer import build_model
    from optimus.train.checkpoint_match import check_checkpoint_matches
    from optimus.train.state import ModelState

    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise UsageError(f"'{run}' is not a run directory (no config.yaml): pass the run.dir of a training run")
    config = load_config(run / "config.yaml")
    manager = CheckpointManager(run)
    step = manager.latest()
    if step is None:
        raise UsageError(f"run '{run}' has no committed checkpoint yet: train it first (optimus train ...)")
    # a config.yaml edited after training must not quietly load part of the weights into another shape
    check_checkpoint_matches(manager.read_meta(step), config, run, fix="restore the run's config.yaml")
    model = build_model(config.model, device="cpu")
    manager.load(step, {"model": ModelState(model)})
    model.eval()
    return config, model


def _seq_len(args: argparse.Namespace, config) -> int:
    """--seq-len where given (0 is refused, not read as "not given"), else the run's own."""
    if args.seq_len is None:
        return config.train.seq_len
    if args.seq_len < 1:
        raise UsageError(f"--seq-len {args.seq_len}: must be at least 1 (or left out for the run's own)")
    return args.seq_len


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from optimus.data.dataset import has_heldout_split, open_token_dataset
    from optimus.data.loader import heldout_batches
    from optimus.data.sources import load_tokenizer
    from optimus.train.evaluate import evaluate

    for flag, value in (("--batches", args.batches), ("--batch-size", args.batch_size)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value})")
    if args.tasks is not None:  # `--tasks ""` names no task, as `--tasks ,,` does: not the held-out loss
        return _eval_tasks(args)
    if args.limit is not None:  # the held-out loss reads --batches, not questions
        raise UsageError("--limit counts the questions of --tasks: add --tasks, or use --batches for the held-out loss")
    config, model = load_run(args.run)
    seq_len = _seq_len(args, config)
    if args.data:
        data = Path(args.data)
        # its held-out split where it has one (a damaged one is an error, not a silent fall back to train.bin)
        split = "heldout" if data.is_dir() and has_heldout_split(data) else "train"
        datasets = [open_token_dataset(data, split=split, tokenizer=config.data.tokenizer)]
    else:
        from optimus.data.build import build_training_data

        datasets = build_training_data(config).heldout
    batches = heldout_batches(datasets, seq_len, args.batch_size, args.batches, config.model.vocab_size)
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
                             max_len=_seq_len(args, config), limit=args.limit,
                             batch_size=args.batch_size)
    print(format_table(results))
    out = Path(args.run) / "eval_tasks.json"
    out.write_text(json.dumps({name: score.as_record() for name, score in results.items()}, indent=2) + "\n")
    print(f"written: {out}")
    return 0


MAX_NEW_TOKENS = 1_000_000  # far past any use of `optimus generate`; more only runs until killed
MIN_TEMPERATURE = 1e-4  # logits of a few hundred over it stay finite in fp32; below, sampling is greedy anyway


def cmd_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from optimus.data.sources import load_tokenizer, tokenizer_info
    from optimus.models.generate import generate

    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if args.max_new_tokens > MAX_NEW_TOKENS:  # no KV cache: each token recomputes the prefix, so this never ends
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} is more than {MAX_NEW_TOKENS:,}: ask for fewer")
    if not 0 <= args.temperature < float("inf"):
        raise UsageError(f"--temperature must be a number >= 0 (0 = greedy; got {args.temperature:g})")
    if 0 < args.temperature < MIN_TEMPERATURE:  # logits / temperature would overflow to inf: nothing to sample from
        raise UsageError(f"--temperature {args.temperature:g} is too small to sample with: use at least "
                         f"{MIN_TEMPERATURE:g}, or 0 for greedy decoding")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed {args.seed}: use 0 <= seed < 2**63 (torch takes a 64-bit seed)")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell's locale could not decode reach Python as lone surrogates
        raise UsageError("--prompt is not valid UTF-8 text: pass it from a UTF-8 locale (e.g. LANG=C.UTF-8)") from None
    config, model = load_run(args.run)
    tokenizer = load_tokenizer(config.data.tokenizer)
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise UsageError("--prompt is empty: give some text to continue")
    if len(ids) + args.max_new_tokens > config.train.seq_len:  # RoPE runs on past it, untrained: say so, go on
        print(f"note: prompt ({len(ids)} tokens) + {args.max_new_tokens} new tokens exceeds the seq_len "
              f"{config.train.seq_len} the model was trained on (train.seq_len); text past it is extrapolated",
              file=sys.stderr)
    generator = torch.Generator().manual_seed(args.seed)
    eos = tokenizer_info(config.data.tokenizer)["eos_id"]
    new = generate(model, torch.tensor([ids]), args.max_new_tokens, args.temperature, eos, generator)
    # the prompt is echoed on its own line, then only the model's continuation (exactly as decoded)
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}, seed {args.seed}"
    print(f"prompt: {args.prompt}")
    print(f"continuation ({new.shape[1]} tokens, {how}): {tokenizer.decode(new[0].tolist())}")
    return 0


def cmd_export(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.data.sources import resolve_tokenizer_path, tokenizer_info
    from optimus.models.hf import ExportTokenizer, export_hf

    output_location("--out", args.out, folder=True)
    config, model = load_run(args.run)
    info = tokenizer_info(config.data.tokenizer)
    tokenizer, note = None, " without a tokenizer: the run's tokenizer has more ids than the model's vocabulary"
    if info["vocab_size"] <= config.model.vocab_size:  # e.g. an imported model with its own small vocabulary
        tokenizer = ExportTokenizer(resolve_tokenizer_path(config.data.tokenizer), info["eos_token"], info["pad_token"])
        note = " with its tokenizer"
    # the context the run trained at, not a fixed 4096: lm-eval and the tokenizer's truncation take it as the window
    out = export_hf(model, config.model, args.out, dense_format=args.dense_format, tokenizer=tokenizer,
                    overwrite=args.overwrite, context_length=config.train.seq_len)
    print(f"exported {args.run} to {out} (Hugging Face transformers layout{note})")
    return 0


def cmd_import(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.checkpoint.manager import CheckpointManager
    from optimus.config import build_config, save_config
    from optimus.models.hf import context_length_from_hf, import_hf, read_hf_config
    from optimus.models.transformer import build_model
    from optimus.train.state import ModelState

    out = output_location("--out", args.out, folder=True)
    if CheckpointManager(out).latest() is not None:
        raise UsageError(f"'{out}' already holds checkpoints: choose a new --out so nothing is overwritten")
    held = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    if held:  # an earlier run's config, metrics or checkpoints would be replaced or left beside the import
        names = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UsageError(f"--out {args.out} already holds files ({names}): import into a new or empty folder")
    # checked before the weights are read: a malformed context should not cost a multi-GB read first
    hf = read_hf_config(args.hf_dir)
    context_length = context_length_from_hf(hf)
    model_config, state_dict = import_hf(args.hf_dir, hf)
    # train at the context the model was trained at, not the library's default
    train = {} if context_length is None else {"seq_len": context_length}
    config = build_config({"model": model_config.model_dump(), "train": train, "run": {"dir": str(out)}})
    model = build_model(config.model, device="cpu")
    model.load_state_dict(state_dict, strict=True)
    CheckpointManager(out).preflight(checkpoint_bytes=sum(t.numel() * 4 for t in state_dict.values()))
    save_config(config, out / "config.yaml")
    CheckpointManager(out).save(0, {"model": ModelState(model)}, {"model": config.model.model_dump(), "contents": ["model"]})
    source = " from config.json's max_position_embeddings" if context_length is not None else ", the default"
    print(f"imported {args.hf_dir} into {out} (step 0, train.seq_len {config.train.seq_len}{source}): "
          f"continue with optimus train {out}/config.yaml (add --train.seq_len=N for another context)")
    return 0


def cmd_report(args: argparse.Namespace, overrides: list[str]) -> int:
    from optimus.report import ReportError, write_report

    if args.out:
        output_location("--out", args.out)
    try:
        path = write_report(args.run, args.out, overwrite=args.overwrite)
    except ReportError as err:
        raise UsageError(str(err)) from None
    print(f"report: {path}")
    return 0


def cmd_verify(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from optimus.checkpoint.preflight import human_bytes
    from optimus.checkpoint.verify import verify_run

    run = Path(args.run)
    if run.is_file():
        raise UsageError(f"'{run}' is a file: pass the run.dir of a training run (the folder holding checkpoints/)")
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
