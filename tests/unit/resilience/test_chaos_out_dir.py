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


def test_a_symlinked_output_folder_is_unlinked_and_what_it_points_to_is_kept(tmp_path):
    """--out/reference may be a link to a folder of the user's (a bigger disk): the link goes, the folder it points
    to and its files stay (removing through the link would delete the user's data)."""
    elsewhere = tmp_path / "big-disk" / "runs"
    (elsewhere / "checkpoints").mkdir(parents=True)
    (elsewhere / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / "reference").symlink_to(elsewhere, target_is_directory=True)
    _clear_earlier_report(out)
    assert not (out / "reference").is_symlink() and list(out.iterdir()) == []
    assert (elsewhere / "keep.txt").read_text() == "mine" and (elsewhere / "checkpoints").is_dir()
