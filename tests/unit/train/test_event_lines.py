"""The operator sees one stderr line for a skipped optimizer step (naming the reason) and one for a
straggler report (naming the slow ranks), with or without the progress bar."""

from __future__ import annotations

from optimus.train.callbacks import EventLines

BASE = {"tokens_per_s": 100.0, "mfu": 0.01}


def test_a_skipped_step_gets_a_line_with_its_reason(capsys):
    events = EventLines()
    events.on_step_end(1, {**BASE, "step": 1, "loss": 3.0, "skipped": False})
    events.on_step_end(2, {**BASE, "step": 2, "loss": 812.5, "skipped": True, "skip_reason": "loss spike"})
    assert capsys.readouterr().err.splitlines() == ["step 2: optimizer step skipped (loss spike, loss 812.5)"]


def test_a_straggler_report_gets_a_line_naming_the_slow_ranks(capsys):
    slow = {"rank": 3, "host": "node7", "step_time_s": 2.5, "median_s": 1.0}
    EventLines().on_step_end(5, {**BASE, "step": 5, "loss": 3.0, "skipped": False, "stragglers": [slow]})
    assert capsys.readouterr().err.splitlines() == ["step 5: straggling ranks (median step 1.000 s): rank 3 (node7) 2.500 s"]
