"""A damaged metrics.jsonl (not UTF-8, a scalar line) is read around, with one warning; a torn last line quietly."""

from __future__ import annotations

import json

import pytest

from optimus.report.records import RunRecords
from optimus.train.callbacks import JsonlMetrics, read_metrics
from optimus.train.callbacks.jsonl import last_records, rewind_metrics

STEP_1 = json.dumps({"step": 1, "loss": 10.0})
STEP_2 = json.dumps({"step": 2, "loss": 9.0})


def _read_back(tmp_path, capsys, text: str) -> tuple[list[int], str]:
    """A metrics.jsonl of `text` read by read_metrics: the steps it kept and what it printed to stderr."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    steps = [r["step"] for r in read_metrics(path)]
    return steps, capsys.readouterr().err


def _resume_at_step_2_and_log_step_3(path) -> None:
    """What the trainer's JSONL logger does to `path` on a resume at step 2 that logs step 3."""
    logger = JsonlMetrics(path)
    logger.on_train_start(start_step=2, max_steps=4)
    logger.on_step_end(3, {"step": 3, "loss": 8.0})
    logger.on_train_end(3)


def test_torn_last_line_is_skipped_without_a_warning(tmp_path, capsys):
    assert _read_back(tmp_path, capsys, f"{STEP_1}\n{STEP_2}\n" + '{"step": 3, "lo') == ([1, 2], "")


def test_non_utf8_and_non_object_lines_are_skipped_with_one_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(f"{STEP_1}\n".encode() + b"\xff\xfe\x00garbage\n123\n[1, 2]\nnot json\n" + f"{STEP_2}\n".encode())
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"warning: {path}: skipped 4 unreadable line(s) (line 2 is not UTF-8)")


def test_scalar_line_is_named_in_the_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f"{STEP_1}\n123\n{STEP_2}\n")
    assert len(read_metrics(path)) == 2
    assert "(line 2 is a JSON int, not an object)" in capsys.readouterr().err


def test_report_records_of_a_damaged_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\x80\x81\n" + f"{STEP_1}\n\"text\"\n{STEP_2}\n".encode())
    records = RunRecords.read(path)
    assert [r["step"] for r in records.steps] == [1, 2]


def test_resume_keeps_the_readable_records_of_a_damaged_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(f"{STEP_1}\n".encode() + b"7\n\xff\n" + f"{STEP_2}\n".encode())
    logger = JsonlMetrics(path)
    logger.on_train_start(start_step=1, max_steps=4)
    logger.on_train_end(1)
    assert [r["step"] for r in read_metrics(path)] == [1]


def test_the_last_records_with_a_field_are_read_line_by_line_past_damage(tmp_path):
    """What `optimus plan --moe-routing` reads of a long run's log: only the last lines that hold the field, parsed;
    a damaged or torn one among them is skipped."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "expert_counts": [[s]]}) for s in range(1, 6)]
    lines.insert(2, json.dumps({"eval_loss": 1.0}))  # no such field: passed over
    lines.insert(4, '{"step": 9, "expert_counts": [[9')  # damaged
    path.write_text("\n".join(lines) + '\n{"expert_counts": [[1')  # torn last line
    assert [r["step"] for r in last_records(path, 4, '"expert_counts"')] == [4, 5]
    assert [r["step"] for r in last_records(path, 10, '"expert_counts"')] == [1, 2, 3, 4, 5]


def test_a_run_killed_while_rewinding_an_unordered_log_keeps_the_whole_history(tmp_path, monkeypatch):
    """Kept records after a dropped one (a log not in step order): copied to a new file renamed over the old."""
    path = tmp_path / "metrics.jsonl"
    text = f"{STEP_1}\n{json.dumps({'step': 3})}\n{STEP_2}\n"
    path.write_text(text)

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr("os.replace", killed)
    with pytest.raises(KeyboardInterrupt):
        JsonlMetrics(path).on_train_start(start_step=2, max_steps=4)
    assert path.read_text() == text  # the rewind to step 2 never half-happened
    monkeypatch.undo()
    rewind_metrics(path, 2)
    assert path.read_text() == f"{STEP_1}\n{STEP_2}\n"


def test_the_trainer_log_is_rewound_by_cutting_its_tail_in_place(tmp_path, monkeypatch):
    """Steps only grow in a log the trainer wrote: the dropped records are its tail, cut off without a copy (one
    truncate, a gigabyte log is not rewritten); a damaged line before the cut stays, a torn last line goes."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(f"{STEP_1}\n".encode() + b"\xff\n" + f"{STEP_2}\n{json.dumps({'step': 3})}\n".encode()
                     + b'{"step": 4, "lo')
    inode = path.stat().st_ino
    monkeypatch.setattr("os.replace", None)  # no copy renamed over it
    _resume_at_step_2_and_log_step_3(path)
    assert path.stat().st_ino == inode
    assert path.read_bytes() == f"{STEP_1}\n".encode() + b"\xff\n" + f"{STEP_2}\n".encode() + \
        json.dumps({"step": 3, "loss": 8.0}).encode() + b"\n"


def test_a_whole_last_record_without_its_newline_is_kept_apart_from_the_next(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f"{STEP_1}\n{STEP_2}")
    _resume_at_step_2_and_log_step_3(path)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_a_log_with_nothing_to_drop_is_left_untouched(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f"{STEP_1}\n{STEP_2}\n")
    before = path.stat().st_mtime_ns
    rewind_metrics(path, 2)
    assert path.stat().st_mtime_ns == before and path.read_text() == f"{STEP_1}\n{STEP_2}\n"


WRONGLY_TYPED = [
    '{"loss": 1.0}',  # no step
    '{"step": "3", "loss": 1.0}',
    '{"step": true, "loss": 1.0}',  # a bool is not a whole-number step
    '{"step": 3, "loss": "abc"}',
    '{"step": 3, "loss": null}',
    '{"step": 3, "eval_loss": "x"}',
    '{"step": 3, "loss": 1.0, "grad_norm": {"a": 1}}',
    '{"step": 3, "checkpoint_save_s": "x"}',
    '{"step": 3, "downstream": 5}',
    '{"step": 3, "downstream": {"piqa": {"acc": "high", "acc_norm": 0.5}}}',
    '{"step": 3, "downstream": {"piqa": {"acc": 0.5}}}',  # no acc_norm
    '{"step": 3, "loss": 1.0, "memory_peak_gib": "big"}',
    '{"step": 3, "loss": 1.0, "expert_counts": "many"}',
]


@pytest.mark.parametrize("line", WRONGLY_TYPED)
def test_a_record_with_wrongly_typed_fields_is_skipped_with_the_warning(tmp_path, capsys, line):
    """An edited line whose step or numbers are not numbers crashed loss.png's redraw mid-training (KeyError on
    'step') and `optimus report` (TypeError): it is damage like an unreadable line, skipped with the one warning."""
    steps, err = _read_back(tmp_path, capsys, f"{STEP_1}\n{line}\n{STEP_2}\n")
    assert steps == [1, 2]
    assert err.count("\n") == 1 and "skipped 1 unreadable line(s) (line 2 has " in err


def test_loss_plot_and_report_read_around_wrongly_typed_records(tmp_path):
    """The two readers the audit crashed: the trainer's loss.png (drawn at every checkpoint) and the report page."""
    from optimus.report.page import write_report
    from optimus.train.callbacks.plot import plot_losses

    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([STEP_1, *WRONGLY_TYPED, STEP_2]) + "\n")
    plot_losses(path, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0
    write_report(tmp_path)
    assert "loss" in (tmp_path / "report.html").read_text()


def test_a_whole_last_line_that_is_not_an_object_is_damage_not_a_torn_write(tmp_path, capsys):
    """Only a last line cut short (not JSON) is a torn write: a whole JSON list there is an edit, warned of."""
    steps, err = _read_back(tmp_path, capsys, f"{STEP_1}\n{STEP_2}\n[1, 2]\n")
    assert steps == [1, 2]
    assert err.count("\n") == 1 and "skipped 1 unreadable line(s) (line 3 is a JSON list, not an object)" in err


def test_the_last_records_with_a_field_leave_out_wrongly_typed_ones(tmp_path):
    """What read_metrics skips as damage (a step that is not a whole number) last_records skips too."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "expert_counts": [[s]]}) for s in (1, 2, 3)]
    lines.insert(1, json.dumps({"step": "9", "expert_counts": [[9]]}))
    path.write_text("\n".join(lines) + "\n")
    assert [r["step"] for r in last_records(path, 10, '"expert_counts"')] == [1, 2, 3]


def test_a_log_whose_every_record_is_dropped_is_emptied(tmp_path):
    """Every record after the step resumed from (the dropped tail starts at the first byte): the log is cut to
    nothing, not left whole."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(f"{json.dumps({'step': 3})}\n{json.dumps({'step': 4})}\n")
    rewind_metrics(path, 2)
    assert path.read_bytes() == b""


def test_a_copied_log_ends_its_last_kept_record_with_a_newline(tmp_path):
    """An unordered log is rewound by copying its kept lines: a last record that lacked its newline gets one, so
    the next step's record starts a line of its own."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(f"{STEP_1}\n{json.dumps({'step': 3})}\n{STEP_2}")
    _resume_at_step_2_and_log_step_3(path)
    assert path.read_text() == f"{STEP_1}\n{STEP_2}\n" + json.dumps({"step": 3, "loss": 8.0}) + "\n"
