"""A DCP reader whose metadata unpickling can only build DCP's own plain record classes.

DCP stores its index (`.metadata`) as a pickle; a plain pickle.load of a file someone handed you
can run arbitrary code. This reader allows only the handful of classes a DCP index is made of.
Tensor payloads are raw bytes and other values are read by DCP with torch.load(weights_only=True).
"""

from __future__ import annotations

import pickle
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED_NAMES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint index refers to '{module}.{name}', which is not allowed")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader that refuses to unpickle anything but DCP index records."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
