"""A run's metrics.jsonl read for the report, line by line, without holding its bulky fields whole.

A long MoE run logs every layer's expert counts at every step (Mula-220B-A10B: 64 x 240 numbers a line, gigabytes
in all) and a large job every rank's peak memory (thousands of numbers a line): as Python lists these would take
many times the file's size. What the panels draw of them is kept instead: per logged step the busiest and idlest
expert of each layer and the highest and lowest rank's memory, and the full counts only at the steps the heatmap
shows (sampled evenly over the steps the log holds, counted in a first pass; first and last step kept)."""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimus.train.callbacks.jsonl import iter_metrics

MAX_HEATMAP_COLUMNS = 120  # logged steps drawn per heatmap: a long run is sampled evenly (last step kept)
MAX_RANKS_DRAWN = 8  # memory per rank drawn one line each up to this many ranks; beyond, the highest and lowest


def relative_loads(counts: np.ndarray) -> np.ndarray:
    """Tokens routed to each expert over an even share of its layer's tokens ([..., experts]; 0 where none)."""
    counts = np.asarray(counts, dtype=np.float64)
    even = counts.mean(axis=-1, keepdims=True)
    return np.divide(counts, even, out=np.zeros_like(counts), where=even > 0)


@dataclass
class ExpertLoads:
    """The expert_counts of a run: the extremes at every logged step, the counts at an even sample of them."""

    steps: list[int]
    highest: np.ndarray  # [step, layer]: the busiest expert's tokens / an even share
    lowest: np.ndarray  # [step, layer]: the idlest expert's
    sample_steps: list[int]  # at most MAX_HEATMAP_COLUMNS, first and last kept
    sample_counts: list[np.ndarray]  # one [layer, expert] array of counts per sampled step


def _count_lines_with(path: Path, marker: bytes) -> int:
    with path.open("rb") as handle:
        return sum(marker in line for line in handle)


class _ExpertLoadReader:
    """Builds ExpertLoads one record at a time: the extremes in flat arrays, the counts only at the picked steps
    (evenly over the `logged` steps the log holds, counted before it is read)."""

    def __init__(self, logged: int):
        self.picks = {round(i * (logged - 1) / (MAX_HEATMAP_COLUMNS - 1)) for i in range(MAX_HEATMAP_COLUMNS)}
        self.steps: list[int] = []
        self.highest, self.lowest = array("d"), array("d")
        self.layers = None
        self.sample: list[tuple[int, np.ndarray]] = []
        self.last: tuple[int, np.ndarray] | None = None

    def add(self, step: int, counts: list[list[int]]) -> None:
        try:
            counts = np.asarray(counts, dtype=np.int64)
        except (TypeError, ValueError):
            return  # ragged or not numbers: a damaged line
        if counts.ndim != 2 or (self.layers is not None and counts.shape[0] != self.layers):
            return  # not [layers][experts], or another shape than the run's first: a damaged line
        self.layers = counts.shape[0]
        loads = relative_loads(counts)
        if len(self.steps) in self.picks:
            self.sample.append((step, counts))
        self.steps.append(step)
        self.highest.extend(loads.max(axis=1).tolist())
        self.lowest.extend(loads.min(axis=1).tolist())
        self.last = (step, counts)

    def result(self) -> ExpertLoads | None:
        if not self.steps:
            return None
        sample = self.sample
        if sample[-1][0] != self.last[0]:  # fewer readable lines than counted (damage): the last step still shown
            sample = sample[:MAX_HEATMAP_COLUMNS - 1] + [self.last]
        shape = (len(self.steps), self.layers)
        return ExpertLoads(steps=self.steps,
                           highest=np.frombuffer(self.highest, dtype=np.float64).reshape(shape),
                           lowest=np.frombuffer(self.lowest, dtype=np.float64).reshape(shape),
                           sample_steps=[step for step, _ in sample], sample_counts=[counts for _, counts in sample])


@dataclass
class RunRecords:
    """metrics.jsonl split by kind of record; each step's expert_counts in `expert_loads`, and where more than
    MAX_RANKS_DRAWN ranks logged memory, each step's memory_peak_gib as [highest, lowest] (the last step's whole,
    in `last_memory_per_rank`)."""

    steps: list[dict[str, Any]] = field(default_factory=list)  # one per logged training step
    evals: list[dict[str, Any]] = field(default_factory=list)  # held-out loss and downstream accuracies
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # save timings
    expert_loads: ExpertLoads | None = None
    last_memory_per_rank: list[float] | None = None

    @classmethod
    def read(cls, metrics_path: Path) -> RunRecords:
        records = cls()
        logged = _count_lines_with(metrics_path, b'"expert_counts"') if metrics_path.is_file() else 0
        experts = _ExpertLoadReader(logged)
        for record in iter_metrics(metrics_path):
            if "loss" in record:
                counts = record.pop("expert_counts", None)
                if counts:
                    experts.add(record["step"], counts)
                memory = record.get("memory_peak_gib")
                if memory:
                    records.last_memory_per_rank = memory
                    if len(memory) > MAX_RANKS_DRAWN:
                        record["memory_peak_gib"] = [max(memory), min(memory)]
                        record["memory_ranks"] = len(memory)
                # one copy of each key for the whole log: a parsed line's keys are its own strings (~0.9 of its
                # ~1.8 KB; a run logging every step of 636k keeps this list whole)
                records.steps.append({sys.intern(key): value for key, value in record.items()})
            elif "eval_loss" in record or "downstream" in record:
                records.evals.append(record)
            elif "checkpoint_save_s" in record:
                records.checkpoints.append(record)
        records.expert_loads = experts.result()
        return records
