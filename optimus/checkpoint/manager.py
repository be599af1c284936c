"""Checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

Layout of a run directory:
    checkpoints/step-N/      DCP shards, `meta.json`, and `COMMITTED` written last
    latest                   the newest committed step number
A save goes to `checkpoints/.tmp-step-N/` first and is renamed once complete, so a crash mid-save
leaves the previous checkpoints untouched and the half-written one is never mistaken for good.
`COMMITTED` records every file's size, so a checkpoint truncated later is caught before loading.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from optimus.checkpoint.safe_reader import SafeFileSystemReader

# DCP warns on every single-process save/load that it assumes one process; that is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

COMMITTED = "COMMITTED"
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the problem and the fix."""


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with open(tmp) as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    """Save and load a dict of Stateful objects (model, optimizer, loader, ...) under a run directory."""

    def __init__(self, run_dir: str | Path, keep_last_k: int = 2):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "checkpoints"
        self.keep_last_k = keep_last_k

    def step_dir(self, step: int) -> Path:
        return self.dir / f"step-{step}"

    def committed_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        if not self.dir.is_dir():
            return []
        steps = []
        for child in self.dir.iterdir():
            if child.name.startswith("step-") and (child / COMMITTED).is_file():
                try:
                    steps.append(int(child.name.removeprefix("step-")))
                except ValueError:
                    continue
        return sorted(steps)

    def latest(self) -> int | None:
        """The newest committed step (the `latest` pointer if it names a committed step)."""
        steps = self.committed_steps()
        pointer = self.run_dir / "latest"
        if pointer.is_file():
            try:
                step = int(pointer.read_text().strip())
            except ValueError:
                step = None
            if step in steps and step == steps[-1]:
                return step
        return steps[-1] if steps else None

    def save(self, step: int, state: dict[str, Stateful | Any], meta: dict[str, Any]) -> Path:
        """Write a checkpoint of `state` for `step` (collective: every rank calls it)."""
        final = self.step_dir(step)
        tmp = self.dir / f".tmp-step-{step}"
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save(state, checkpoint_id=tmp)
        if _is_rank0():
            (tmp / META).write_text(json.dumps({"step": step, **meta}, indent=1))
            sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
            _write_atomically(tmp / COMMITTED, json.dumps(sizes, indent=1))
            if final.exists():  # a stale copy of this step from a run that died after committing
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_atomically(self.run_dir / "latest", str(step))
            self._prune(keep=step)
        _barrier()
        return final

    def _prune(self, keep: int) -> None:
        steps = self.committed_steps()
        for old in steps[: max(0, len(steps) - self.keep_last_k)]:
            if old != keep:
                shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def read_meta(self, step: int) -> dict[str, Any]:
        """The checkpoint's meta.json, after checking that every file is there at its committed size."""
        path = self.step_dir(step)
        try:
            sizes = json.loads((path / COMMITTED).read_text())
            for name, size in sizes.items():
                if (path / name).stat().st_size != size:
                    raise CheckpointError(f"file '{name}' is {(path / name).stat().st_size} bytes, expected {size}")
            return json.loads((path / META).read_text())
        except CheckpointError as err:
            raise CheckpointError(f"checkpoint {path} is damaged ({err}): delete that folder to resume from an earlier one") from None
        except (OSError, ValueError) as err:
            raise CheckpointError(
                f"checkpoint {path} is damaged ({type(err).__name__}: {err}): delete that folder to resume from an earlier one"
            ) from None

    def load(self, step: int, state: dict[str, Stateful | Any]) -> None:
        """Load `state` in place from the checkpoint of `step` (any world size: DCP reshards)."""
        path = self.step_dir(step)
        self.read_meta(step)
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(path))
        except Exception as err:  # DCP wraps per-rank failures; report one line, not a traceback
            detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"checkpoint {path} could not be loaded ({detail[:200]}): delete it or use another run.dir") from None
