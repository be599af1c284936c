"""`optimus verify RUN`: check every checkpoint of a run (sizes, hashes, index, values) without loading it."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from optimus.checkpoint.integrity import COMMITTED, ManifestError, check_files, read_manifest
from optimus.checkpoint.manager import DAMAGED_PREFIX, INDEX, META, CheckpointError, check_meta
from optimus.checkpoint.safe_reader import UnsafeCheckpoint, read_index
from optimus.checkpoint.values import read_values


@dataclass
class CheckpointReport:
    """One checkpoint folder and what, if anything, is wrong with it."""

    name: str
    step: int
    files: int
    bytes: int
    problem: str | None  # None: good

    @property
    def ok(self) -> bool:
        return self.problem is None


def _step_of(name: str) -> int | None:
    try:
        return int(name.removeprefix(DAMAGED_PREFIX).removeprefix("step-").split(".")[0])
    except ValueError:
        return None


def check_checkpoint(folder: Path) -> str | None:
    """What is wrong with one checkpoint folder, or None when it would load."""
    try:
        records = read_manifest(folder)
    except ManifestError as err:
        return str(err)
    for required in (META, INDEX):
        if required not in records:
            return f"{COMMITTED} does not list '{required}'"
    problem = check_files(folder, records)
    if problem is not None:
        return problem
    try:
        check_meta(json.loads((folder / META).read_text()))
    except CheckpointError as err:
        return str(err)
    except (OSError, ValueError) as err:
        return f"{META} unreadable ({type(err).__name__})"
    try:
        index = read_index(folder)
        saved_values = read_values(folder)
    except (UnsafeCheckpoint, pickle.UnpicklingError) as err:
        return f"{err}"
    except (OSError, ValueError, EOFError, AttributeError, TypeError) as err:
        return f"index or values unreadable ({type(err).__name__})"
    if saved_values is not None:  # written with values.json: Optimus stores no pickled byte items
        pickled = [fqn for fqn, md in index.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
        if pickled:
            return f"index holds pickled item '{pickled[0]}', which Optimus never writes (altered checkpoint)"
    return None


def verify_run(run_dir: Path) -> list[CheckpointReport]:
    """A report for every step-N and damaged-step-N folder of the run, oldest step first."""
    checkpoints = Path(run_dir) / "checkpoints"
    reports = []
    for folder in checkpoints.iterdir() if checkpoints.is_dir() else []:
        step = _step_of(folder.name)
        if not folder.is_dir() or step is None or not (folder.name.startswith(("step-", DAMAGED_PREFIX))):
            continue
        files = [p for p in folder.iterdir() if p.is_file()]
        problem = check_checkpoint(folder)
        if folder.name.startswith(DAMAGED_PREFIX):
            problem = "moved aside on resume: " + (problem or f"now passes; rename it to step-{step} to use it again")
        reports.append(CheckpointReport(folder.name, step, len(files), sum(p.stat().st_size for p in files), problem))
    return sorted(reports, key=lambda r: (r.step, r.name))
