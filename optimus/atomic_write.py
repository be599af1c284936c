"""Files the user or a later run reads are written under a temporary name and renamed into place: they appear whole
or not at all, so a disk that fills (or a kill) mid-write leaves neither a cut-short file nor the temporary one.

Checkpoints add fsyncs and a manifest on top of this (optimus/checkpoint/integrity.py); the token files stream
through their own temporary files (optimus/data/tokenize.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_whole(path: str | Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` a hidden temporary file beside `path` (named by this process), then rename it over `path`; the
    temporary file is removed if anything fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_whole(path: str | Path, text: str) -> None:
    """write_whole for a text."""
    write_whole(path, lambda tmp: tmp.write_text(text))
