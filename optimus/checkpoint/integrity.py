"""Each checkpoint file's size and BLAKE2b hash, recorded in the COMMITTED manifest and checked before a load.

The rank that writes a file hashes it right after writing (see writer.py), so hashing is spread over the
ranks and reads back from the page cache; rank 0 only merges the results when it commits. Checking reads
the files in a few threads (hashlib releases the GIL on large buffers). A manifest from before hashes
(name -> size) is still accepted and checked by size.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

COMMITTED = "COMMITTED"
HASHES_SUFFIX = "hashes.json"  # per-rank sidecar "__<rank>_hashes.json", merged into COMMITTED at commit
_FORMAT = 2
_THREADS = 8


class ManifestError(ValueError):
    """A COMMITTED manifest that cannot be read."""


@dataclass(frozen=True)
class FileRecord:
    size: int
    blake2b: str | None  # None: written before hashes were recorded


def hash_file(path: Path) -> str:
    """BLAKE2b-256 of a file's bytes, as hex."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=32)).hexdigest()


def hash_files(folder: Path, names: list[str]) -> dict[str, str]:
    """name -> hash of each file, a few files at a time."""
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(_THREADS, len(names))) as pool:
        return dict(zip(names, pool.map(lambda name: hash_file(folder / name), names)))


def write_json_durably(path: Path, text: str) -> None:
    """Write, fsync and atomically rename into place, so a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Make the folder's entries (a rename into it, a new file) durable: a rename is a change to the folder,
    and until the folder itself is fsynced a power cut may undo it even though the file's bytes were synced."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform that cannot open folders (Windows): renames there are as durable as it allows
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (and Windows) refuse fsync on a folder; the rename still happened
        pass
    finally:
        os.close(fd)


def seal(folder: Path) -> None:
    """Rank 0, once every rank has written: record every file's size and hash in COMMITTED.

    Uses the hashes the writing ranks left in their sidecars (which are then removed) and hashes the
    remaining small files (DCP's index, meta.json, values.json) itself.
    """
    known: dict[str, str] = {}
    for sidecar in sorted(folder.glob(f"__*_{HASHES_SUFFIX}")):
        known.update(json.loads(sidecar.read_text()))
        sidecar.unlink()
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != COMMITTED)
    digests = {**hash_files(folder, [n for n in names if n not in known]), **{n: known[n] for n in names if n in known}}
    files = {name: {"bytes": (folder / name).stat().st_size, "blake2b": digests[name]} for name in names}
    write_json_durably(folder / COMMITTED, json.dumps({"format": _FORMAT, "files": files}, indent=1))


def read_manifest(folder: Path) -> dict[str, FileRecord]:
    """The files COMMITTED lists, with sizes and (when recorded) hashes."""
    try:
        data = json.loads((folder / COMMITTED).read_text())
    except (OSError, ValueError) as err:
        raise ManifestError(f"{COMMITTED} cannot be read ({type(err).__name__})") from None
    try:
        if isinstance(data, dict) and data.get("format") == _FORMAT:
            return {name: FileRecord(int(r["bytes"]), str(r["blake2b"])) for name, r in data["files"].items()}
        if isinstance(data, dict) and all(isinstance(size, int) for size in data.values()):
            return {name: FileRecord(size, None) for name, size in data.items()}  # sizes only: older checkpoints
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    raise ManifestError(f"{COMMITTED} is not a manifest Optimus wrote")


def check_files(folder: Path, records: dict[str, FileRecord], names: list[str] | None = None) -> str | None:
    """What is wrong with the listed files (all of them by default), or None when each has its size and hash."""
    names = sorted(records) if names is None else names
    for name in names:
        if "/" in name or name in ("", ".", ".."):
            return f"{COMMITTED} lists '{name}', which is not a file name"
        try:
            size = (folder / name).stat().st_size
        except OSError:
            return f"file '{name}' is missing"
        if size != records[name].size:
            return f"file '{name}' is {size} bytes, {COMMITTED} says {records[name].size} (truncated or overwritten)"
    hashed = [name for name in names if records[name].blake2b is not None]
    try:
        digests = hash_files(folder, hashed)
    except OSError as err:
        return f"a file cannot be read ({type(err).__name__}: {err.strerror or err})"
    for name in hashed:
        if digests[name] != records[name].blake2b:
            return f"file '{name}' does not match its BLAKE2b hash in {COMMITTED} (bit rot or an edit)"
    return None
