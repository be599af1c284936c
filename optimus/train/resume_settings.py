"""What a resumed run changed: settings that alter what its steps compute, against the run's own config.yaml.

A run may be resumed with other settings on purpose (a lower learning rate, more data sources). The earlier
config.yaml is then the only record of what the steps before the resume used, so it is kept beside the new one,
and rank 0 says in one line what differs. Not listed: how long the run goes, how often it logs, evaluates or
checkpoints, the layout and memory knobs (a checkpoint reshards to any layout), and the model (a checkpoint of
another model is refused: checkpoint_match.check_checkpoint_matches).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from optimus.config import Config

# whole sections, and single train keys, whose change changes what the steps compute or read
MEANINGFUL_SECTIONS = ("data", "optim")
MEANINGFUL_TRAIN_KEYS = ("seq_len", "global_batch_size", "seed", "dtype")


def _flat(tree: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}"))
    return out


def _meaningful(raw: dict[str, Any]) -> dict[str, Any]:
    chosen = {section: raw.get(section) for section in MEANINGFUL_SECTIONS}
    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    chosen["train"] = {key: train.get(key) for key in MEANINGFUL_TRAIN_KEYS}
    flat: dict[str, Any] = {}
    for section, tree in chosen.items():
        flat.update(_flat(tree, section))
    return flat


def changed_settings(saved: Path, config: Config) -> list[str]:
    """'key: before -> now' for each meaningful setting in which `config` differs from the config file `saved`
    (empty when the file is missing or unreadable: there is nothing to compare with)."""
    try:
        before = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError):
        return []
    if not isinstance(before, dict):
        return []
    old, new = _meaningful(before), _meaningful(config.model_dump(mode="json"))
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)]


def _free_name(run_dir: Path, stem: str, step: int, suffix: str) -> Path:
    """run_dir/STEM-before-step-N.SUFFIX, or .2, .3, ... before the suffix where that is taken."""
    target = run_dir / f"{stem}-before-step-{step}{suffix}"
    count = 1
    while target.exists():
        count += 1
        target = run_dir / f"{stem}-before-step-{step}.{count}{suffix}"
    return target


def keep_earlier_config(run_dir: Path, step: int) -> Path:
    """Copy the run's config.yaml to config-before-step-N.yaml (N: the step resumed from; a free name)."""
    target = _free_name(run_dir, "config", step, ".yaml")
    shutil.copy2(run_dir / "config.yaml", target)
    return target


def keep_earlier_metrics(run_dir: Path) -> Path:
    """Move a metrics.jsonl that is not this run's to metrics-before-step-0.jsonl (a free name): a run starting
    afresh rewinds its log to step 0, which would drop every record of it. A rename: a log of gigabytes is not
    copied, and a kill meanwhile leaves it under one name or the other."""
    target = _free_name(run_dir, "metrics", 0, ".jsonl")
    os.replace(run_dir / "metrics.jsonl", target)
    return target
