"""`optimus chaos --out DIR` replaces an earlier chaos run's outputs there and nothing else."""

from __future__ import annotations

from optimus.resilience.chaos import CHAOS_OUTPUTS, _clear_earlier_report


def test_only_an_earlier_chaos_runs_outputs_are_removed(tmp_path):
    for name in CHAOS_OUTPUTS:
        if "." in name:
            (tmp_path / name).write_text("old")
        else:
            (tmp_path / name / "checkpoints").mkdir(parents=True)
    (tmp_path / "NOTES.txt").write_text("mine")
    (tmp_path / "sub").mkdir()
    _clear_earlier_report(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["NOTES.txt", "sub"]
    _clear_earlier_report(tmp_path / "absent")  # nothing there yet: nothing to do
