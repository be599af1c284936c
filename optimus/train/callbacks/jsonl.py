"""metrics.jsonl: one JSON object per logged step, per evaluation and per committed checkpoint;
rewound on resume so no step appears twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from optimus.train.callbacks.base import Callback


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (a torn last line from a killed run is skipped)."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class JsonlMetrics(Callback):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.handle = None

    def on_train_start(self, start_step: int, max_steps: int) -> None:
        # Steps after the checkpoint we resume from will be computed again: drop their old records.
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
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
