"""The console progress prints one line for a skipped optimizer step, naming the reason."""

from __future__ import annotations

import io

from rich.console import Console

from optimus.train.callbacks import ConsoleProgress


def test_a_skipped_step_gets_a_line_with_its_reason():
    out = io.StringIO()
    progress = ConsoleProgress(Console(file=out, width=200, force_terminal=False))
    progress.on_train_start(0, 10)
    base = {"tokens_per_s": 100.0, "mfu": 0.01}
    progress.on_step_end(1, {**base, "step": 1, "loss": 3.0, "skipped": False})
    progress.on_step_end(2, {**base, "step": 2, "loss": 812.5, "skipped": True, "skip_reason": "loss spike"})
    progress.on_train_end(2)
    lines = [line for line in out.getvalue().splitlines() if "skipped" in line]
    assert lines == ["step 2: optimizer step skipped (loss spike, loss 812.5)"]
