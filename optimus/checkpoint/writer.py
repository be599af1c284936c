"""DCP's file writer, plus what each rank owes the manifest: its non-tensor values and its files' hashes.

Both are written inside DCP's write step, so a failure there (disk full, permissions) travels through
DCP's own error path to every rank, for synchronous and background saves alike.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from optimus.checkpoint.integrity import HASHES_SUFFIX, hash_files, write_json_durably
from optimus.checkpoint.values import VALUES


class CheckpointWriter(FileSystemWriter):
    """FileSystemWriter that also writes this rank's values JSON and hashes every file it wrote."""

    def __init__(self, path: str | Path, values_json: str):
        super().__init__(path)
        self.values_json = values_json

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        folder, prefix = Path(self.path), plan.storage_data.prefix  # "__<rank>_", unique per rank
        write_json_durably(folder / f"{prefix}{VALUES}", self.values_json)
        names = sorted({result.storage_data.relative_path for result in results} | {f"{prefix}{VALUES}"})
        write_json_durably(folder / f"{prefix}{HASHES_SUFFIX}", json.dumps(hash_files(folder, names)))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done
