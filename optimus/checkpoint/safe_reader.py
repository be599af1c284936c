"""Loading a DCP checkpoint without unpickling anything but DCP's own index records.

DCP trusts the checkpoint in two places, and a file someone handed you could run code through either:
- its index (`.metadata`) is a pickle: it is read here by an unpickler that builds only the few plain
  record classes an index is made of (named one by one; no dotted names that could reach further);
- an item the index marks as bytes, which DCP's default planner reads with torch.load(weights_only=False).
  SafeLoadPlanner refuses byte items where the live state holds a tensor, and reads expected ones (older
  checkpoints kept optimizer hyperparameters so) with weights_only=True. Optimus itself writes no byte items:
  non-tensor state goes to values.json (values.py).
Tensor items are read by DCP with torch.load(weights_only=True), whose unpickler only rebuilds tensors.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

_META_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_META_MODULE, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(ValueError):
    """A checkpoint that asks for something loading must never do (one-line message)."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint index refers to '{module}.{name}', which is not allowed")


def read_index(path: Path) -> Metadata:
    """The checkpoint's DCP index, unpickled with only DCP's record classes allowed, and checked for shape."""
    with open(path / ".metadata", "rb") as handle:
        metadata = _IndexUnpickler(handle).load()
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpoint("the checkpoint index is not a DCP Metadata record")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise UnsafeCheckpoint("the checkpoint index holds an entry that is not a DCP storage record")
        name = str(info.relative_path)
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise UnsafeCheckpoint(f"the checkpoint index points '{index.fqn}' at '{name}', outside its folder")
        if info.transform_descriptors:
            raise UnsafeCheckpoint(f"the checkpoint index asks to transform '{index.fqn}' on load, which Optimus never writes")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader over a checked index; it reads only for a SafeLoadPlanner."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        self._index = read_index(Path(path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpoint("per-rank checkpoint indexes are not supported: save with the global index")
        metadata = self._index
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        if not isinstance(planner, SafeLoadPlanner):
            raise UnsafeCheckpoint("SafeFileSystemReader reads only with SafeLoadPlanner (no general unpickling)")
        return super().read_data(plan, planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that never unpickles a byte item with more than torch's weights-only unpickler,
    and refuses byte items the live state does not expect (where it holds a tensor)."""

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        for fqn, live in self.state_dict.items():
            if isinstance(live, torch.Tensor) and isinstance(stored.get(fqn), BytesStorageMetadata):
                raise UnsafeCheckpoint(
                    f"checkpoint stores '{fqn}' as pickled bytes where a tensor belongs: refusing to unpickle it "
                    "(the checkpoint was altered or is not from Optimus)"
                )
        plan = super().create_local_plan()
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO and isinstance(self.state_dict.get(item.dest_index.fqn), torch.Tensor):
                raise UnsafeCheckpoint(f"checkpoint item '{item.dest_index.fqn}' is bytes where a tensor belongs")
        return plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if isinstance(self.state_dict.get(read_item.dest_index.fqn), torch.Tensor):
            raise UnsafeCheckpoint(f"checkpoint item '{read_item.dest_index.fqn}' is bytes where a tensor belongs")
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or ["refused"]
            # torch's text opens with advice to retry with weights_only=False; keep the line saying what was refused
            first = next((line for line in lines if "unsupported" in line.lower() or "WeightsUnpickler" in line),
                         lines[0])
            raise UnsafeCheckpoint(
                f"checkpoint item '{read_item.dest_index.fqn}' holds a pickle that is not plain data ({first[:160]}): "
                "refusing to load it"
            ) from None
        # where DefaultLoadPlanner.load_bytes puts the value (it differs only in how it unpickles)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
