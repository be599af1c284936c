"""Checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

Layout of a run directory:
    checkpoints/step-N/      DCP shards, `meta.json`, and `COMMITTED` written last
    latest                   the newest committed step number
A save goes to `checkpoints/.tmp-step-N/` first and is renamed once complete, so a crash mid-save
leaves the previous checkpoints untouched and the half-written one is never mistaken for good.
`COMMITTED` records every file's size, so a checkpoint truncated later is caught before loading.

An asynchronous save copies the state to CPU memory and returns; DCP writes it in a background thread
while training goes on, and `finish_pending()` commits it once written. Until then it is only a
`.tmp-step-N` folder, which resume ignores, so a process killed meanwhile loses nothing committed.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
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


def _describe(err: BaseException) -> str:
    """One line for a failure, looking through DCP's per-rank wrapper to the first rank's own error."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (cause, _) = next(iter(err.failures.items()))
        return f"rank {rank}: {_describe(cause)}"
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


@dataclass
class _PendingSave:
    """An asynchronous save whose files are still being written in the background."""

    step: int
    tmp: Path
    meta: dict[str, Any]
    write: Future


class CheckpointManager:
    """Save and load a dict of Stateful objects (model, optimizer, loader, ...) under a run directory."""

    def __init__(self, run_dir: str | Path, keep_last_k: int = 2):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "checkpoints"
        self.keep_last_k = keep_last_k
        self._pending: _PendingSave | None = None
        self._async_group: dist.ProcessGroup | None = None

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

    def save(self, step: int, state: dict[str, Stateful | Any], meta: dict[str, Any],
             asynchronous: bool = False) -> Path:
        """Write a checkpoint of `state` for `step` (collective: every rank calls it).

        asynchronous: return once the state is copied to CPU memory; the files are written in the
        background and the checkpoint is committed by the next `finish_pending()` (or save, or load).
        """
        self.finish_pending()
        tmp = self.dir / f".tmp-step-{step}"
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        if asynchronous:
            write = dcp.async_save(state, checkpoint_id=tmp, process_group=self._background_group())
            self._pending = _PendingSave(step, tmp, meta, write)
        else:
            dcp.save(state, checkpoint_id=tmp)
            if _is_rank0():
                self._commit(step, tmp, meta)
            _barrier()
        return self.step_dir(step)

    def _background_group(self) -> dist.ProcessGroup | None:
        # DCP's background thread runs collectives (plan, write results) while the training thread
        # runs its own on the default group: on one gloo group the two interleave and crash or hang.
        if not dist.is_initialized():
            return None
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")  # collective: every rank saves together
        return self._async_group

    def finish_pending(self) -> int | None:
        """Wait for the asynchronous save, if any, and commit it; return its step (collective).

        A failed write raises CheckpointError on every rank and commits nothing: the earlier
        checkpoints stay as they were and `latest` still names the newest of them.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        failure = None
        try:
            pending.write.result()
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            failure = _describe(err)
        if not self._written_on_every_rank(failure is None):
            failure = failure or "another rank failed to write its part"
            if _is_rank0():
                shutil.rmtree(pending.tmp, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint {self.step_dir(pending.step)} could not be written ({failure}): check free space and "
                f"permissions under {self.dir}; the earlier checkpoints are intact and a rerun resumes from them"
            )
        if _is_rank0():
            self._commit(pending.step, pending.tmp, pending.meta)
        _barrier()
        return pending.step

    def _written_on_every_rank(self, written: bool) -> bool:
        if self._async_group is None:
            return written
        flag = torch.tensor([int(written)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._async_group)
        return bool(flag.item())

    def finish_pending_on_exit(self) -> int | None:
        """For a process leaving on an error: commit the asynchronous save if its write succeeded.

        No collectives (the other ranks may be gone or stuck): DCP's coordinator, rank 0, only
        succeeds once every rank has written its files, so rank 0 alone may commit. A failed write
        is dropped silently here; the error that ended training is the one to report.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.write.result()
        except (Exception, CheckpointException):
            return None
        if not _is_rank0():
            return None
        self._commit(pending.step, pending.tmp, pending.meta)
        return pending.step

    def _commit(self, step: int, tmp: Path, meta: dict[str, Any]) -> None:
        """Rank 0, once every rank's files are written: mark them complete and make them the latest."""
        final = self.step_dir(step)
        (tmp / META).write_text(json.dumps({"step": step, **meta}, indent=1))
        sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        _write_atomically(tmp / COMMITTED, json.dumps(sizes, indent=1))
        if final.exists():  # a stale copy of this step from a run that died after committing
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomically(self.run_dir / "latest", str(step))
        self._prune(keep=step)

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
        self.finish_pending()
        path = self.step_dir(step)
        self.read_meta(step)
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(path))
        except (Exception, CheckpointException) as err:  # DCP wraps per-rank failures; one line, not a traceback
            raise CheckpointError(
                f"checkpoint {path} could not be loaded ({_describe(err)}): delete it or use another run.dir"
            ) from None
