"""`optimus info`: parameters and FLOPs per token of the presets, or of a config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_info(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from optimus.config import ConfigError, load_config
    from optimus.models.flops import count_parameters, flops_per_token
    from optimus.models.presets import PRESETS
    from optimus.models.transformer import build_model

    if args.seq_len < 1:
        raise ConfigError(f"--seq-len must be at least 1 (got {args.seq_len})")
    rows = dict(PRESETS)  # no target: every preset
    highlight = None
    target = Path(args.target) if args.target else None
    if target is not None and args.target not in PRESETS and not target.is_file():
        if target.suffix in (".yaml", ".yml") or "/" in args.target or target.exists():  # meant as a file
            what = "is a directory" if target.is_dir() else "not found"
            raise ConfigError(f"config file '{args.target}' {what}: give the path of a YAML config, or a preset "
                              f"({', '.join(sorted(PRESETS))})")
        raise ConfigError(f"unknown preset '{args.target}': choose one of {', '.join(sorted(PRESETS))} or a config file")
    if target is not None and target.is_file():
        highlight = "config"
        rows = {"config": load_config(args.target, overrides).model}
    elif overrides:  # --model.* overrides (as `optimus train` and `plan` take them) make one model: show that one
        preset = [f"--model.preset={args.target}"] if args.target else []
        highlight = "config"
        rows = {"config": load_config(None, preset + overrides).model}
    elif args.target:
        rows = {args.target: PRESETS[args.target]}  # only the one asked (each row builds a meta model)
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


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
