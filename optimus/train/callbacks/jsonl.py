"""metrics.jsonl: one JSON object per logged step, per evaluation and per committed checkpoint;
rewound on resume so no step appears twice.

Every reader here goes line by line: a long MoE run logs its expert counts at every step, so its log is
gigabytes, more than a reader should hold at once."""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from optimus.train.callbacks.base import Callback


def _parse(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(the line's record, None), or (None, why it is not one)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "is not UTF-8"
    except json.JSONDecodeError:
        return None, "is not JSON"
    if not isinstance(record, dict):
        return None, f"is a JSON {type(record).__name__}, not an object"
    return record, None


# Fields the readers compute with (loss.png, the report's panels, the console): a record holding another type
# there came from an edit or damage and is skipped as an unreadable line is, not left to crash a reader (or a
# training run redrawing loss.png) later. None is allowed where the trainer may not know the value.
_REQUIRED_NUMBERS = ("loss", "eval_loss")
_OPTIONAL_NUMBERS = ("ce_loss", "aux_loss", "z_loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s",
                     "tokens_per_s_per_device", "mfu", "checkpoint_save_s", "checkpoint_blocking_s",
                     "expert_load_max", "expert_load_min", "memory_planned_gib")
_NUMBERS = _REQUIRED_NUMBERS + _OPTIONAL_NUMBERS


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _malformed(record: dict[str, Any]) -> str | None:
    """Why a parsed record cannot be read as one of the trainer's, or None."""
    if type(record.get("step")) is not int:  # (a bool is an int to isinstance)
        return "has no whole-number 'step'"
    for key in _NUMBERS:
        if key in record and not (_is_number(record[key]) or (record[key] is None and key in _OPTIONAL_NUMBERS)):
            return f"has {json.dumps(record[key])[:40]} as '{key}', not a number"
    downstream = record.get("downstream", {})
    if not isinstance(downstream, dict) or not all(
            isinstance(score, dict) and all(_is_number(score.get(key)) for key in ("acc", "acc_norm"))
            for score in downstream.values()):
        return "has a 'downstream' that is not task names to {acc, acc_norm}"
    memory = record.get("memory_peak_gib", [])
    if not isinstance(memory, list) or not all(map(_is_number, memory)):
        return "has a 'memory_peak_gib' that is not a list of numbers"
    if not isinstance(record.get("expert_counts", []), list):  # (its rows are checked where read, as one array)
        return "has an 'expert_counts' that is not a list"
    return None


def iter_metrics(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a metrics.jsonl, one JSON object at a time, read line by line.

    A torn last line (a run killed mid-write) is skipped quietly. Any other line that is not a JSON object in
    UTF-8, or whose step or numbers are not numbers (an edited or damaged file), is skipped too, with one warning
    line on stderr (once the file is read through) that counts them and names the first: the rest of the run's
    history stays readable.
    """
    path = Path(path)
    if not path.is_file():
        return
    skipped: list[str] = []
    with path.open("rb") as handle:
        number, pending = 0, None  # one line held back: only the last may be torn quietly
        for line in handle:
            if pending is not None:
                yield from _record_or_skip(pending, number, skipped, last=False)
            number += 1
            pending = line
        if pending is not None:
            yield from _record_or_skip(pending, number, skipped, last=True)
    if skipped:
        print(f"warning: {path}: skipped {len(skipped)} unreadable line(s) ({skipped[0]}): they are left out; "
              "remove or fix them to silence this warning", file=sys.stderr)


def _record_or_skip(line: bytes, number: int, skipped: list[str], last: bool) -> Iterator[dict[str, Any]]:
    if not line.strip():
        return
    record, why = _parse(line)
    if record is not None and (why := _malformed(record)) is not None:
        record, last = None, False  # whole JSON: damage, not a torn write
    if record is not None:
        yield record
    elif not (last and why == "is not JSON"):  # the last line may be torn; any earlier one is damage
        skipped.append(f"line {number} {why}")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (iter_metrics, as a list): for small logs and tests."""
    return list(iter_metrics(path))


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
    return [record for record, _ in map(_parse, kept) if record is not None and _malformed(record) is None]


def _dropped(line: bytes, start_step: int) -> bool:
    """Whether a rewind to `start_step` drops this line: a record of a later step, or a torn last line."""
    record, _ = _parse(line)
    if record is None:
        return not line.endswith(b"\n")  # torn (only the last line can lack its newline); damage elsewhere stays
    step = record.get("step", 0)
    return isinstance(step, (int, float)) and step > start_step


def rewind_metrics(path: str | Path, start_step: int) -> None:
    """Drop the records of the steps after `start_step` (a resumed run computes them again) and a torn last line.

    Line by line. Where the dropped lines are the file's tail (a log the trainer wrote: its steps only grow) the file
    is cut there, one truncate, so a run killed meanwhile has the old log or the cut one, and a log of gigabytes is
    not copied; otherwise the kept lines go to a new file, fsynced and renamed over the old. Lines that are not
    records stay where they are (readers skip them with a warning): nothing but the dropped steps is lost.
    """
    path = Path(path)
    if not path.is_file():
        return
    cut, kept_after_cut, offset, ends_in_newline = None, False, 0, True
    with path.open("rb") as handle:
        for line in handle:
            if _dropped(line, start_step):
                cut = offset if cut is None else cut
            elif line.strip():
                kept_after_cut = kept_after_cut or cut is not None
                ends_in_newline = line.endswith(b"\n")
            offset += len(line)
    if cut is None and ends_in_newline:
        return
    if not kept_after_cut:
        with path.open("r+b") as handle:
            handle.truncate(offset if cut is None else cut)
            if cut is None:  # a whole last record missing only its newline: the next one must not join it
                handle.seek(0, os.SEEK_END)
                handle.write(b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        return
    tmp = path.with_name(path.name + ".tmp")
    with path.open("rb") as source, tmp.open("wb") as target:
        for line in source:
            if not _dropped(line, start_step):
                target.write(line if line.endswith(b"\n") else line + b"\n")
        target.flush()
        os.fsync(target.fileno())
    os.replace(tmp, path)


class JsonlMetrics(Callback):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.handle = None

    def on_train_start(self, start_step: int, max_steps: int) -> None:
        # Steps after the checkpoint we resume from will be computed again: drop their old records.
        rewind_metrics(self.path, start_step)
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
