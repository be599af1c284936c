"""Bad flags and outputs of the run verbs, refused with one line before anything is written: report's --out,
import's --out, eval's --tasks/--limit/--batches/--batch-size, generate's --temperature/--max-new-tokens, and an output
folder no file can be made in (plan's --json)."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.cli import main
from optimus.cli.errors import output_location
from tests.helpers.runs import one_error_line


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, small_token_dir):
    """A one-step dense run with its metrics.jsonl and a committed checkpoint."""
    from optimus.config import build_config
    from optimus.train.trainer import Trainer
    from tests.helpers.runs import tiny_run_config

    run = tmp_path_factory.mktemp("tiny") / "run"
    raw = tiny_run_config(run, small_token_dir, train=dict(max_steps=1, ckpt_every=1, eval_every=0))
    Trainer(build_config(raw), progress_bar=False).fit()
    return run


def test_report_refuses_an_existing_out_file_and_keeps_it(tiny_run, capsys):
    config = tiny_run / "config.yaml"
    before = config.read_bytes()
    assert main(["report", str(tiny_run), "--out", str(config)]) == 2
    assert one_error_line(capsys).endswith(f"error: --out {config} already exists: choose another file, or pass "
                                            "--overwrite to replace it")
    assert config.read_bytes() == before


def test_report_rewrites_its_own_file_and_replaces_another_with_overwrite(tiny_run, tmp_path, capsys):
    assert main(["report", str(tiny_run)]) == 0
    assert main(["report", str(tiny_run)]) == 0  # RUN/report.html is the report's own: rewritten freely
    assert main(["report", str(tiny_run), "--out", str(tiny_run / "report.html")]) == 0
    other = tmp_path / "page.html"
    other.write_text("mine")
    assert main(["report", str(tiny_run), "--out", str(other), "--overwrite"]) == 0
    assert other.read_text().startswith("<!DOCTYPE html>")


def test_import_refuses_a_folder_that_holds_files_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "old-run"
    (out / "checkpoints" / "step-5").mkdir(parents=True)  # no COMMITTED: not a checkpoint the manager lists
    (out / "config.yaml").write_text("run: {dir: old}\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["import", str(tmp_path / "no-hf-dir"), "--out", str(out)]) == 2
    assert one_error_line(capsys).endswith(f"error: --out {out} already holds files (checkpoints, config.yaml, "
                                            "metrics.jsonl): import into a new or empty folder")
    assert (out / "config.yaml").read_text() == "run: {dir: old}\n"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]


def test_import_names_a_few_files_of_a_full_folder(tmp_path, capsys):
    for name in "abcde":
        (tmp_path / name).write_text("")
    assert main(["import", str(tmp_path / "no-hf-dir"), "--out", str(tmp_path)]) == 2
    assert "already holds files (a, b, c, ...)" in one_error_line(capsys)


@pytest.mark.parametrize("tasks", ["", ",,"])
def test_eval_with_no_task_named_is_refused_alike(tiny_run, tasks, capsys):
    assert main(["eval", str(tiny_run), "--tasks", tasks]) == 2
    assert one_error_line(capsys).endswith("error: --tasks names no task: pass e.g. --tasks arc_easy,hellaswag")


@pytest.mark.parametrize("flag,value", [("--batches", "0"), ("--batch-size", "-1"), ("--batch-size", "0")])
def test_eval_flags_below_one_name_the_flag(tmp_path, flag, value, capsys):
    # checked before the run is read: no run needed
    assert main(["eval", str(tmp_path), flag, value]) == 2
    assert one_error_line(capsys).endswith(f"error: {flag} must be at least 1 (got {value})")


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_eval_tasks_with_a_limit_below_one_is_one_line(tmp_path, limit, capsys):
    """--limit 0 or -1 names no question of a task to score: one line before the run is read (no run needed)."""
    assert main(["eval", str(tmp_path), "--tasks", "arc_easy", "--limit", limit]) == 2
    assert one_error_line(capsys).endswith("error: --limit must be at least 1 (or left out for every question)")


@pytest.mark.parametrize("temperature", ["1e-45", "1e-300", "5e-5"])
def test_generate_refuses_a_temperature_too_small_to_sample_with(tmp_path, temperature, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "hi", "--temperature", temperature]) == 2
    assert one_error_line(capsys).endswith(f"error: --temperature {float(temperature):g} is too small to sample "
                                            "with: use at least 0.0001, or 0 for greedy decoding")


def test_generate_refuses_a_never_ending_continuation(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "100000000"]) == 2
    assert one_error_line(capsys).endswith("error: --max-new-tokens 100000000 is more than 1,000,000: ask for fewer")


def test_generate_samples_at_the_smallest_temperature(tiny_run, capsys):
    assert main(["generate", str(tiny_run), "--prompt", "The", "--max-new-tokens", "2",
                 "--temperature", "1e-4"]) == 0
    assert "temperature 0.0001, seed 0" in capsys.readouterr().out


def test_eval_data_with_a_damaged_heldout_split_is_refused_not_read_as_train(tiny_run, small_token_dir, tmp_path,
                                                                             capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(small_token_dir, data)
    (data / "heldout.bin").unlink()  # heldout.json says the split is there: train.bin is not what was asked for
    assert main(["eval", str(tiny_run), "--data", str(data), "--batches", "1"]) == 2
    assert "heldout.bin does not exist" in one_error_line(capsys)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_plan_refuses_a_json_file_in_a_folder_no_file_can_be_made_in_before_searching(capsys):
    # os.access calls /proc writable for root (CI containers): the check makes a file to be sure
    assert main(["plan", "configs/mula-tiny-moe.yaml", "--cluster", "h100", "--devices", "8",
                 "--json", "/proc/optimus-plan.json"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("error: --json /proc/optimus-plan.json: /proc is not writable: choose a "
                                             "path you can write"), err
    assert "valid layouts" not in captured.out  # refused before the search (it prints "N valid layouts of ...")


def test_an_output_check_leaves_nothing_in_the_folder(tmp_path):
    assert output_location("--json", tmp_path / "sub" / "plan.json") == tmp_path / "sub" / "plan.json"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("folder", [False, True])
def test_an_output_under_a_file_is_refused_as_such(tmp_path, folder):
    """A path whose nearest existing part is a file (a mistyped --out under notes.txt) is named as a file up front,
    not reported as an unwritable folder."""
    from optimus.cli.errors import UsageError

    (tmp_path / "notes.txt").write_text("mine")
    target = tmp_path / "notes.txt" / "sub" / "plan.json"
    with pytest.raises(UsageError, match=f"^--out {target}: {tmp_path / 'notes.txt'} is a file, not a directory: "
                                         "choose another path$"):
        output_location("--out", target, folder=folder)


def test_an_existing_output_folder_no_file_can_be_made_in_is_refused_though_its_parent_is_writable(tmp_path,
                                                                                                   monkeypatch):
    """--out names a folder that exists: the files go into it, so it must be writable itself (its parent being
    writable is not enough). chmod does not stop root (as tests may run), so the write check itself is told which
    folder refuses files."""
    from optimus.cli import errors

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(errors, "_can_create_in", lambda where: where != out)
    with pytest.raises(errors.UsageError, match=f"^--out {out}: {out} is not writable: choose a path you can write$"):
        output_location("--out", out, folder=True)
    assert output_location("--out", tmp_path / "other", folder=True) == tmp_path / "other"  # a new one beside it


@pytest.mark.parametrize("flags, line", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--max-new-tokens", "-3"], "--max-new-tokens must be at least 1"),
    (["--seed", str(2**63)], f"--seed {2**63}: use 0 <= seed < 2**63 (torch takes a 64-bit seed)"),
    (["--seed", "-1"], "--seed -1: use 0 <= seed < 2**63 (torch takes a 64-bit seed)"),
])
def test_generate_flags_at_the_edge_of_their_range_are_refused_before_the_run_is_read(tmp_path, flags, line, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "hi", *flags]) == 2
    assert one_error_line(capsys).endswith(f"error: {line}")


@pytest.mark.parametrize("flags", [["--max-new-tokens", "1000000"], ["--max-new-tokens", "1"],
                                   ["--seed", str(2**63 - 1)], ["--temperature", "0"]])
def test_generate_flags_at_their_largest_or_smallest_allowed_value_reach_the_run(tmp_path, flags, capsys):
    """Accepted, so the next check to fail is the run folder's (tmp_path is none)."""
    assert main(["generate", str(tmp_path), "--prompt", "hi", *flags]) == 2
    assert "is not a run directory (no config.yaml)" in one_error_line(capsys)
