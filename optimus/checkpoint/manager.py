"""Checkpoints with torch.distributed.checkpoint (DCP), committed atomically, checked before loading.

Layout of a run directory:
    checkpoints/step-N/          DCP shards, `.metadata`, `values.json`, `meta.json`, `COMMITTED` last
    checkpoints/damaged-step-N/  a checkpoint that failed its check on resume, or a step-N folder without COMMITTED
                                 (not one of our saves: a copy cut short), moved aside, never deleted
    latest                       the newest committed step number
A save goes to `checkpoints/.tmp-step-N/` first and is renamed once complete, so a crash mid-save
leaves the previous checkpoints untouched and the half-written one is never mistaken for good.
`COMMITTED` records every file's size and BLAKE2b hash (integrity.py); a load checks them first, each
rank a share of the files. Non-tensor state is JSON (values.py) and loading never unpickles more than
DCP's own index records (safe_reader.py).

An asynchronous save copies the state to CPU memory and returns; DCP writes it in a background thread
while training goes on, and `finish_pending()` commits it once written. Until then it is only a
`.tmp-step-N` folder, which resume ignores, so a process killed meanwhile loses nothing committed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from optimus.checkpoint.integrity import (
    COMMITTED,
    ManifestError,
    check_files,
    fsync_folder,
    read_manifest,
    seal,
    write_json_durably,
)
from optimus.checkpoint.preflight import RunDirError, check_run_dir, human_bytes
from optimus.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner, read_index
from optimus.checkpoint.values import (
    UnsupportedValue, encode_values, live_state, merge_rank_values, read_values, restore_values, split_values,
)
from optimus.checkpoint.writer import CheckpointWriter

META = "meta.json"
INDEX = ".metadata"
DAMAGED_PREFIX = "damaged-"
UNCOMMITTED = f"no {COMMITTED} marker: not a complete checkpoint (a copy cut short, or its marker deleted)"
_MESSAGE_BYTES = 480  # a problem's text as exchanged between ranks


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the problem and the fix."""


@contextmanager
def _single_process_dcp_quiet() -> Iterator[None]:
    """Around a DCP call: DCP warns on every single-process save/load that it assumes one process,
    which is intended here; the filter is scoped to the call so importing this module changes nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _describe(err: BaseException) -> str:
    """One line for a failure, looking through DCP's per-rank wrapper to the first rank's own error."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (cause, _) = next(iter(err.failures.items()))
        return f"rank {rank}: {_describe(cause)}"
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


@dataclass
class _PendingSave:
    """An asynchronous save whose files are still being written in the background."""

    step: int
    tmp: Path
    meta: dict[str, Any]
    write: Future
    quiet: ExitStack  # DCP's single-process warning filter, held until the background write is over

    def wait(self) -> None:
        """Block until the background write is done (re-raising its error), then drop the warning filter."""
        try:
            self.write.result()
        finally:
            self.quiet.close()


class CheckpointManager:
    """Save and load a dict of Stateful objects (model, optimizer, loader, ...) under a run directory."""

    def __init__(self, run_dir: str | Path, keep_last_k: int = 2, device: torch.device | None = None):
        """device: where this rank's tensors for collectives on the default group live (the training device;
        CPU when None, which suits gloo and single processes)."""
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "checkpoints"
        self.keep_last_k = keep_last_k
        self.device = device or torch.device("cpu")
        self._pending: _PendingSave | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._checked: set[int] = set()  # steps whose files passed their check in this process

    def step_dir(self, step: int) -> Path:
        return self.dir / f"step-{step}"

    def step_folders(self) -> dict[int, bool]:
        """{step: committed} for every checkpoints/step-N folder: committed ones hold their COMMITTED marker."""
        if not self.dir.is_dir():
            return {}
        steps = {}
        for child in self.dir.iterdir():
            if child.name.startswith("step-") and child.is_dir():
                try:
                    step = int(child.name.removeprefix("step-"))
                except ValueError:
                    continue
                steps[step] = (child / COMMITTED).is_file()
        return steps

    def committed_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        return sorted(step for step, committed in self.step_folders().items() if committed)

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

    def preflight(self, checkpoint_bytes: int) -> None:
        """Before training: fail now, in one line, if checkpoints of about `checkpoint_bytes` could not be
        written under the run directory (collective: every rank checks and all stop together)."""
        self.finish_pending()
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            check_run_dir(self.run_dir, checkpoint_bytes, probe_name=f".write-test-{rank}")
            problem = None
        except RunDirError as err:
            problem = str(err)
        problem = self._first_problem_on_any_rank(problem)
        if problem is not None:
            raise CheckpointError(problem)

    # ------------------------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Stateful | Any], meta: dict[str, Any],
             asynchronous: bool = False) -> Path:
        """Write a checkpoint of `state` for `step` (collective: every rank calls it).

        asynchronous: return once the state is copied to CPU memory; the files are written in the
        background and the checkpoint is committed by the next `finish_pending()` (or save, or load).
        Any failure raises CheckpointError (one line) and leaves the earlier checkpoints as they were.
        """
        self.finish_pending()
        try:
            tensors, values = split_values(live_state(state))
            values_json = encode_values(values)
        except UnsupportedValue as err:
            raise CheckpointError(f"cannot checkpoint {err}") from None
        tmp = self.dir / f".tmp-step-{step}"
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            problem = None
        except OSError as err:
            problem = _describe(err)
        problem = self._first_problem_on_any_rank(problem)
        if problem is not None:
            raise self._write_failed(step, tmp, problem)
        writer = CheckpointWriter(tmp, values_json)
        if asynchronous:
            # one process: DCP warns from its writer thread, so the filter is held until the write is waited for
            quiet = ExitStack()
            if not dist.is_initialized():
                quiet.enter_context(_single_process_dcp_quiet())
            try:
                write = dcp.async_save(tensors, storage_writer=writer, process_group=self._background_group())
            except (Exception, CheckpointException) as err:
                quiet.close()
                raise self._write_failed(step, tmp, _describe(err)) from None
            self._pending = _PendingSave(step, tmp, meta, write, quiet)
            return self.step_dir(step)
        failure = None
        try:
            with _single_process_dcp_quiet():
                dcp.save(tensors, storage_writer=writer)
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            failure = _describe(err)
        if failure is None and _is_rank0():
            try:
                self._commit(step, tmp, meta)
            except OSError as err:
                failure = _describe(err)
        failure = self._first_problem_on_any_rank(failure)
        if failure is not None:
            raise self._write_failed(step, tmp, failure)
        return self.step_dir(step)

    def _write_failed(self, step: int, tmp: Path, failure: str) -> CheckpointError:
        full = self._disk_full_note()  # before the partial files are removed, which frees space again
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(
            f"checkpoint {self.step_dir(step)} could not be written ({failure}){full}: check free space and "
            f"permissions under {self.dir}; the earlier checkpoints are intact and a rerun resumes from them"
        )

    def _disk_full_note(self) -> str:
        # torch.save reports a full disk as "unexpected pos N vs M": say what it means
        try:
            free = shutil.disk_usage(self.dir).free
            steps = self.committed_steps()
            size = sum(p.stat().st_size for p in self.step_dir(steps[-1]).iterdir()) if steps else 16 << 20
        except OSError:
            return ""
        return f"; the disk is full ({human_bytes(free)} free, a checkpoint takes about {human_bytes(size)})" \
            if free < size else ""

    def _background_group(self) -> dist.ProcessGroup | None:
        # DCP's background thread runs collectives (plan, write results) while the training thread runs its own
        # on the default group: on one gloo group the two interleave and crash or hang.
        if not dist.is_initialized():
            return None
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")  # collective: every rank saves together
        return self._async_group

    def _first_problem_on_any_rank(self, problem: str | None) -> str | None:
        """Collective on the default group (never while a background save runs: callers finish it first):
        every rank learns the first rank's problem (None when no rank has one)."""
        if not dist.is_initialized():
            return problem
        mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        text = (problem or "").encode()[:_MESSAGE_BYTES]
        if text:
            mine[: len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        mine = mine.to(self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        for rank, message in enumerate(everyone):
            decoded = bytes(message.tolist()).rstrip(b"\0").decode(errors="ignore")
            if decoded:
                return decoded if decoded.startswith("rank ") else f"rank {rank}: {decoded}"  # same text on every rank
        return None

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
            pending.wait()
        except (Exception, CheckpointException) as err:
            failure = _describe(err)
        if failure is None and _is_rank0():
            try:
                self._commit(pending.step, pending.tmp, pending.meta)
            except OSError as err:
                failure = _describe(err)
        failure = self._first_problem_on_any_rank(failure)
        if failure is not None:
            raise self._write_failed(pending.step, pending.tmp, failure)
        return pending.step

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
            pending.wait()
        except (Exception, CheckpointException):
            return None
        if not _is_rank0():
            return None
        self._commit(pending.step, pending.tmp, pending.meta)
        return pending.step

    def _commit(self, step: int, tmp: Path, meta: dict[str, Any]) -> None:
        """Rank 0, once every rank's files are written: seal them in COMMITTED and make them the latest."""
        final = self.step_dir(step)
        self._checked.discard(step)
        write_json_durably(tmp / META, json.dumps({"step": step, **meta}, indent=1))
        merge_rank_values(tmp)
        seal(tmp)
        if final.exists():  # not ours to delete: a save never leaves one (resume moves aside any it would pass)
            os.replace(final, self._aside_path(step))
        os.replace(tmp, final)
        fsync_folder(self.dir)  # the step's folder keeps its final name across a power cut before `latest` names it
        write_json_durably(self.run_dir / "latest", str(step))
        self._prune(keep=step)

    def _prune(self, keep: int) -> None:
        # Checkpoints found damaged were moved aside (damaged-step-N), so the k kept are the newest that
        # were not known to be bad; the one just committed is always kept.
        steps = self.committed_steps()
        for old in steps[: max(0, len(steps) - self.keep_last_k)]:
            if old != keep:
                shutil.rmtree(self.step_dir(old), ignore_errors=True)

    # ------------------------------------------------------------------------------------ check
    def find_problem(self, step: int) -> str | None:
        """What is wrong with the checkpoint of `step`, or None when every file has its committed size and
        hash (collective: each rank checks a share of the files; a pending asynchronous save is committed first)."""
        self.finish_pending()
        if step in self._checked:
            return None
        path = self.step_dir(step)
        try:
            records = read_manifest(path)
            missing = [name for name in (META, INDEX) if name not in records]
            if missing:
                problem = f"{COMMITTED} does not list '{missing[0]}'"
            else:
                rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
                problem = check_files(path, records, sorted(records)[rank::world])
        except ManifestError as err:
            problem = str(err)
        problem = self._first_problem_on_any_rank(problem)
        if problem is None:
            self._checked.add(step)
        return problem

    def newest_usable(self) -> tuple[int | None, list[str]]:
        """(the newest checkpoint that passes its check, notes on newer ones skipped) - collective.

        Skipped checkpoints are moved to checkpoints/damaged-step-N, never deleted, so that pruning does
        not count them as good ones. When none passes, raises CheckpointError and moves nothing.
        """
        bad: list[tuple[int, str]] = []
        folders = self.step_folders()
        for step in sorted(folders, reverse=True):
            # a step folder without its marker is no checkpoint (our saves rename a complete, sealed folder into
            # place), yet it holds someone's files: it is set aside like a damaged one, and never overwritten
            problem = self.find_problem(step) if folders[step] else UNCOMMITTED
            if problem is None:
                return step, [self._move_aside(old, why) for old, why in bad]
            bad.append((step, problem))
        if bad:
            step, why = bad[0]
            more = f" (and {len(bad) - 1} older ones)" if len(bad) > 1 else ""
            raise CheckpointError(
                f"checkpoint {self.step_dir(step)} is damaged ({why}){more} and no earlier one is usable: restore "
                f"it from a copy, or move {self.dir} away to start from scratch (nothing was deleted)"
            )
        return None, []

    def _aside_path(self, step: int) -> Path:
        """A free checkpoints/damaged-step-N[.k] name for the folder of `step`."""
        target = self.dir / f"{DAMAGED_PREFIX}step-{step}"
        suffix = 1
        while target.exists():
            suffix += 1
            target = self.dir / f"{DAMAGED_PREFIX}step-{step}.{suffix}"
        return target

    def _move_aside(self, step: int, why: str) -> str:
        source = self.step_dir(step)
        target = self._aside_path(step)
        _barrier()  # every rank has picked the same name before rank 0 renames
        if _is_rank0():
            os.replace(source, target)
        _barrier()
        return f"step-{step} ({why}; kept as {target.relative_to(self.run_dir)})"

    def read_meta(self, step: int) -> dict[str, Any]:
        """The checkpoint's meta.json, after checking that every file is there at its committed size
        (sizes only: cheap; `find_problem` also checks the hashes)."""
        path = self.step_dir(step)
        try:
            for name, record in read_manifest(path).items():
                size = (path / name).stat().st_size
                if size != record.size:
                    raise CheckpointError(f"file '{name}' is {size} bytes, {COMMITTED} says {record.size}")
            try:
                meta = json.loads((path / META).read_text())
            except ValueError as err:  # (a hash that matches damage: the file was edited and COMMITTED with it)
                raise CheckpointError(f"{META} is not JSON: {err}") from None
            check_meta(meta)
            return meta
        except (CheckpointError, ManifestError) as err:
            problem = str(err)
        except (OSError, ValueError) as err:
            problem = f"{type(err).__name__}: {err}"
        raise CheckpointError(f"checkpoint {path} is damaged ({problem}): move it away, and training and the other "
                              "verbs use the one before it")

    # ------------------------------------------------------------------------------------ load
    def load(self, step: int, state: dict[str, Stateful | Any]) -> None:
        """Load `state` in place from the checkpoint of `step` (any world size: DCP reshards).

        Checks every file's size and hash first (collective). Tensors are read by DCP through a reader
        and planner that unpickle nothing but DCP's index records; other values come from values.json.
        """
        self.finish_pending()
        path = self.step_dir(step)
        problem = self.find_problem(step)
        if problem is not None:
            raise CheckpointError(
                f"checkpoint {path} is damaged ({problem}): `optimus verify {self.run_dir}` lists the good ones; "
                "training resumes from the newest good one by itself"
            )
        try:
            live = live_state(state)
            saved_values = read_values(path)
            tensors, _ = split_values(live)
            # checkpoints from before values.json keep non-tensor values as byte items (read weights-only)
            target = tensors if saved_values is not None else live
            stand_ins = _take_stand_ins(state, target, path)
            with _single_process_dcp_quiet():
                dcp.load(target, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
            if stand_ins:  # read in place into the live tensors, then put back where load_state_dict looks
                with _single_process_dcp_quiet():
                    dcp.load({source: tensor for source, (_, _, tensor) in stand_ins.items()},
                             storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
                for entry, key, tensor in stand_ins.values():
                    target[entry][key] = tensor
            if saved_values is not None:
                restore_values(live, saved_values)
            for key, value in state.items():
                if isinstance(value, Stateful):
                    value.load_state_dict(live[key])
        except (Exception, CheckpointException) as err:  # DCP wraps per-rank failures; one line, not a traceback
            raise CheckpointError(
                f"checkpoint {path} could not be loaded ({_describe(err)}): move it to "
                f"{self.dir / (DAMAGED_PREFIX + path.name)} and rerun to resume from the one before, or use another "
                "run.dir"
            ) from None


def check_meta(meta: Any) -> None:
    """meta.json as the trainer reads it: an object whose `model` is an object and `contents` a list of names."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{META} holds a {type(meta).__name__}, not an object")
    if not isinstance(meta.get("model", {}), dict):
        raise CheckpointError(f"{META}'s 'model' is not an object")
    contents = meta.get("contents", [])
    if not isinstance(contents, list) or not all(isinstance(name, str) for name in contents):
        raise CheckpointError(f"{META}'s 'contents' is not a list of names")


def _take_stand_ins(state: dict[str, Stateful | Any], target: dict[str, Any], path: Path) -> dict[str, tuple]:
    """Entries to read from other checkpoint keys than their own, taken out of `target`.

    A Stateful may name them with `stand_ins()` -> {its key: checkpoint key to read instead}, used where the
    checkpoint lacks the key (a bf16 zero1/zero2 optimizer's fp32 master weights are the fp32 parameters an
    fsdp run saved), and with `better_sources()`, used wherever the checkpoint holds the other key (an fp32
    model resuming a bf16 zero run reads that run's fp32 masters, not its bf16-rounded parameters). Returns
    {checkpoint key: (entry, key, live tensor)} for a second load; one line on stderr (rank 0) says so.
    """
    def offers(method: str) -> dict[str, dict[str, str]]:
        return {entry: getattr(value, method)() for entry, value in state.items()
                if hasattr(value, method) and isinstance(target.get(entry), dict)}

    missing, better = offers("stand_ins"), offers("better_sources")
    if not any(missing.values()) and not any(better.values()):
        return {}
    saved = set(read_index(path).state_dict_metadata)
    taken: dict[str, tuple] = {}
    for entry, sources in better.items():
        for key, source in sources.items():
            if source in saved and key in target[entry]:
                taken[source] = (entry, key, target[entry].pop(key))
    for entry, sources in missing.items():
        for key, source in sources.items():
            if f"{entry}.{key}" not in saved and source in saved and key in target[entry]:
                taken[source] = (entry, key, target[entry].pop(key))
    if taken and _is_rank0():
        source, (entry, key, _) = next(iter(taken.items()))
        print(f"checkpoint {path.name}: {len(taken)} entries read from other entries it holds (e.g. {entry}.{key} "
              f"from {source})", file=sys.stderr, flush=True)
    return taken
