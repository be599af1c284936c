"""Files written whole: under a hidden temporary name beside the target, renamed into place, and nothing left
behind where the write fails."""

from __future__ import annotations

import os

import pytest

from optimus.atomic_write import write_text_whole, write_whole


def test_the_temporary_file_is_hidden_beside_the_target_and_named_by_this_process(tmp_path):
    """Beside it (a rename within one folder cannot cross file systems), hidden (a listing of the folder, or a glob
    of its *.json, never shows a half-written file), and this process's (two writers never share one)."""
    seen = []

    def write(tmp):
        seen.append(tmp)
        tmp.write_text("whole")

    write_whole(tmp_path / "plan.json", write)
    assert seen == [tmp_path / f".plan.json.{os.getpid()}.tmp"]
    assert (tmp_path / "plan.json").read_text() == "whole" and os.listdir(tmp_path) == ["plan.json"]


def test_a_failed_write_leaves_the_earlier_file_and_no_temporary_one(tmp_path):
    """A disk that fills mid-write: the file keeps its earlier text, and the cut-short temporary file is removed."""
    target = tmp_path / "best.yaml"
    write_text_whole(target, "earlier\n")

    def fails_midway(tmp):
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_whole(target, fails_midway)
    assert target.read_text() == "earlier\n" and os.listdir(tmp_path) == ["best.yaml"]
