"""DCP's file writer, plus what each rank owes the manifest: its non-tensor values and its files' hashes.

Both are written inside DCP's write step, so a failure there (disk full, permissions) travels through
DCP's own error path to every rank, for synchronous and background saves alike. An asynchronous save's
staging copy keeps FlatRangeTensors (the zero optimizer's state, checkpoint/flat_range.py) as themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from optimus.checkpoint.flat_range import FlatRangeTensor
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

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The CPU copy an asynchronous save writes from. DCP's copies every tensor as a plain tensor of its own
        size, which would turn a FlatRangeTensor into its bare 1-D range: those are copied by `staged()`."""
        ranges: list[tuple[tuple, FlatRangeTensor]] = []

        def without_ranges(node: dict, path: tuple) -> dict:
            kept = {}
            for key, value in node.items():
                if isinstance(value, FlatRangeTensor):
                    ranges.append(((*path, key), value.staged()))
                else:
                    kept[key] = without_ranges(value, (*path, key)) if isinstance(value, dict) else value
            return kept

        staged = super().stage(without_ranges(state_dict, ()))
        for path, value in ranges:
            node = staged
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
        return staged
