"""What an attacker or a failing disk does to a committed checkpoint (test helpers, not shipped)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from optimus.checkpoint.integrity import seal


class _TouchMarker:
    """Unpickling this creates the marker file: proof that loading ran code from the checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def plant_payload(checkpoint: Path, fqn: str, marker: Path) -> None:
    """Append a pickle payload to a shard, point `fqn` at it as a byte item, and rewrite COMMITTED so that
    every size and hash matches again (the attacker knows the manifest format)."""
    index_path = checkpoint / ".metadata"
    metadata = pickle.loads(index_path.read_bytes())  # the test's own file: plain pickle is fine here
    shard = sorted(checkpoint.glob("*.distcp"))[0]
    buffer = io.BytesIO()
    torch.save(_TouchMarker(marker), buffer)
    payload = buffer.getvalue()
    offset = shard.stat().st_size
    with open(shard, "ab") as handle:
        handle.write(payload)
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != fqn}
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo(shard.name, offset, len(payload))
    index_path.write_bytes(pickle.dumps(metadata))
    reseal(checkpoint)


def reseal(checkpoint: Path) -> None:
    """Rewrite COMMITTED from the files as they are now."""
    if (checkpoint / "COMMITTED").exists():
        (checkpoint / "COMMITTED").unlink()
        seal(checkpoint)


def flip_bytes_in_tensor(checkpoint: Path, tensor: torch.Tensor, count: int = 64) -> Path:
    """Invert `count` bytes in the middle of `tensor`'s stored data (found by its bytes) in the shard that
    holds it; COMMITTED is left as it was, like bit rot. Returns the shard."""
    needle = tensor.detach().contiguous().cpu().numpy().tobytes()
    for shard in sorted(checkpoint.glob("*.distcp")):
        data = bytearray(shard.read_bytes())
        at = data.find(needle)
        if at >= 0:
            middle = at + len(needle) // 2
            for i in range(middle, middle + min(count, len(needle) // 2)):
                data[i] ^= 0xFF
            shard.write_bytes(bytes(data))
            return shard
    raise AssertionError("the tensor's bytes are in no shard")


def flip_bytes_in_item(checkpoint: Path, fqn: str, count: int = 4096) -> Path:
    """Invert `count` bytes in the middle of the stored item `fqn` (a large tensor: its data dominates the
    record); COMMITTED is left as it was, like bit rot. Returns the shard."""
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # the test's own file
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    shard = checkpoint / info.relative_path
    data = bytearray(shard.read_bytes())
    start = info.offset + info.length // 2
    for i in range(start, start + min(count, info.length // 4)):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard
