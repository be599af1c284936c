#!/usr/bin/env python
"""Has this run reached train.max_steps?  The job scripts ask before they requeue themselves.

    python examples/launch/run_finished.py CONFIG [--section.key=value ...]

Resolves the config with optimus's own loader, exactly as `optimus train CONFIG ... --dry-run` does
(run.dir, run.name, train.max_steps; in-process rather than parsing the dry run's output: one Python
start-up, not two), then reads the run's `latest` (the newest committed step). Prints one line.
Exit 0: finished (latest >= max_steps); 1: not yet (preempted or out of time: resubmit);
2: cannot tell (the config does not load; its one-line message is shown).
"""

from __future__ import annotations

import sys
from pathlib import Path

from optimus.config import ConfigError, load_config


def main(argv: list[str]) -> int:
    """Print 'finished' or 'not finished' for the run CONFIG + overrides describe; see the module doc."""
    if not argv:
        print("usage: run_finished.py CONFIG [--section.key=value ...]", file=sys.stderr)
        return 2
    # Only optimus knows how a config resolves (defaults, presets, overrides): ask it, do not re-derive.
    try:
        config = load_config(argv[0], argv[1:])
    except ConfigError as err:
        print(f"run_finished.py: {err}", file=sys.stderr)
        return 2
    run_dir, max_steps = config.run.path, config.train.max_steps
    pointer = run_dir / "latest"
    try:
        latest = int(pointer.read_text().strip()) if pointer.is_file() else 0
    except ValueError:
        latest = 0  # a torn pointer: optimus itself falls back to the newest committed step on resume
    finished = latest >= max_steps
    print(f"{'finished' if finished else 'not finished'}: {run_dir} at step {latest} of {max_steps}")
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
