"""Start-up checks of a run directory, so that a run that could never save fails before its first step."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Per parameter: fp32 weights plus AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_PARAMETER = 3 * 4


class RunDirError(ValueError):
    """A run directory checkpoints cannot be written to (one-line message with the fix)."""


def human_bytes(n: float) -> str:
    """A byte count for people: 512 B, 3.2 MiB, 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def check_run_dir(run_dir: Path, checkpoint_bytes: int, probe_name: str = ".write-test") -> None:
    """Raise RunDirError unless checkpoints can be written under `run_dir`: it is a directory (created if
    missing), `checkpoints` is a writable directory, `latest` is a file or absent, and the free space
    holds one more checkpoint of `checkpoint_bytes`."""
    run_dir = Path(run_dir)
    checkpoints, latest = run_dir / "checkpoints", run_dir / "latest"
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run.dir '{run_dir}' is a file, not a directory: set run.dir to a directory")
    if checkpoints.exists() and not checkpoints.is_dir():
        raise RunDirError(f"'{checkpoints}' is a file: move it away; checkpoints are written into that folder")
    if latest.exists() and not latest.is_file():
        raise RunDirError(f"'{latest}' is not a file: remove it; Optimus writes the newest step number there")
    try:
        checkpoints.mkdir(parents=True, exist_ok=True)
        probe = checkpoints / probe_name
        with open(probe, "wb") as handle:
            handle.write(b"\0" * 4096)
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()
    except OSError as err:
        raise RunDirError(
            f"cannot write checkpoints under run.dir '{run_dir}' ({err.strerror or type(err).__name__}): "
            "choose a writable run.dir"
        ) from None
    free = shutil.disk_usage(checkpoints).free
    if free < checkpoint_bytes:
        raise RunDirError(
            f"only {human_bytes(free)} free under '{checkpoints}', but a checkpoint of this model takes about "
            f"{human_bytes(checkpoint_bytes)} (weights and two Adam moments in fp32): free some space or choose "
            "another run.dir"
        )
