"""metrics.jsonl: one JSON object per logged step, per evaluation and per committed checkpoint;
rewound on resume so no step appears twice."""

from __future__ import annotations

import json
import sys
from collections import deque
from pathlib import Path
from typing import Any

from optimus.train.callbacks.base import Callback


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl, each a JSON object.

    A torn last line (a run killed mid-write) is skipped quietly. Any other line that is not a JSON
    object in UTF-8 (an edited or damaged file) is skipped too, with one warning line on stderr that
    counts them and names the first: the rest of the run's history stays readable.
    """
    records: list[dict[str, Any]] = []
    path = Path(path)
    if not path.is_file():
        return records
    lines = path.read_bytes().splitlines()
    skipped: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            skipped.append(f"line {number} is not UTF-8")
            continue
        except json.JSONDecodeError:
            if number < len(lines):  # the last line may be torn; any earlier one is damage
                skipped.append(f"line {number} is not JSON")
            continue
        if not isinstance(record, dict):
            skipped.append(f"line {number} is a JSON {type(record).__name__}, not an object")
            continue
        records.append(record)
    if skipped:
        print(f"warning: {path}: skipped {len(skipped)} unreadable line(s) ({skipped[0]}): they are left out; "
              "remove or fix them to silence this warning", file=sys.stderr)
    return records


def last_records(path: str | Path, count: int, marker: str) -> list[dict[str, Any]]:
    """The last `count` records of a metrics.jsonl whose line holds `marker` (e.g. a field's quoted name), in order.

    Line by line, keeping only `count` lines: a long run's log (an MoE's expert counts every step, for hundreds of
    thousands of steps) is gigabytes, more than read_metrics should hold at once. Lines that are not JSON objects
    are skipped, as read_metrics skips them (without its warning: only the kept lines are parsed)."""
    kept: deque[bytes] = deque(maxlen=count)
    needle = marker.encode("utf-8")
    with Path(path).open("rb") as handle:
        for line in handle:
            if needle in line:
                kept.append(line)
    records = []
    for line in kept:
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class JsonlMetrics(Callback):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.handle = None

    def on_train_start(self, start_step: int, max_steps: int) -> None:
        # Steps after the checkpoint we resume from will be computed again: drop their old records.
        from optimus.checkpoint.integrity import write_json_durably

        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
        # a new file renamed over the old: a run killed while rewinding keeps its whole history
        write_json_durably(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.handle = self.path.open("a")

    def _write(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self._write(metrics)

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None:
        self._write(metrics)

    def on_checkpoint_timing(self, step: int, record: dict[str, Any]) -> None:
        self._write(record)

    def on_train_end(self, step: int) -> None:
        if self.handle:
            self.handle.close()
