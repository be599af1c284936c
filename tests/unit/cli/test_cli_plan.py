"""`optimus plan`'s own flags (optimus/cli/plan.py): each refused value is one line and exit 2 before the search,
and what the command prints of a restricted search."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.cli import main
from tests.helpers.runs import one_error_line

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
PLAN = ["plan", str(CONFIGS / "mula-tiny-moe.yaml"), "--cluster", "h100", "--devices", "8"]


@pytest.fixture
def no_search(monkeypatch):
    def search(*args, **kwargs):
        raise AssertionError("the search ran before the flags were checked")

    monkeypatch.setattr("optimus.plan.search.plan", search)


@pytest.mark.parametrize("flags, message", [
    (["--top", "0"], "--top must be at least 1 (got 0)"),
    (["--tokens", "0"], "--tokens must be a positive number of tokens (got 0)"),
    (["--tokens=-1e9"], "--tokens must be a positive number of tokens (got -1e+09)"),
    (["--tokens", "inf"], "--tokens must be a positive number of tokens (got inf)"),
    (["--moe-imbalance", "inf"], "a number of at least 1 (got inf)"),
])
def test_a_flag_the_plan_cannot_use_is_refused_in_one_line_before_the_search(flags, message, no_search, capsys):
    """A table of no rows, or days and carbon for no tokens, is no plan: said before minutes of searching."""
    assert main([*PLAN, *flags]) == 2
    assert message in one_error_line(capsys)


@pytest.mark.parametrize("text, tokens", [("100e9", 100e9), ("100B", 100e9), ("2.5t", 2.5e12), ("500M", 5e8),
                                          ("64k", 64e3), ("5G", 5e9), (" 4T ", 4e12)])
def test_a_token_budget_is_read_as_people_write_it(text, tokens):
    """`--tokens 100B` as the papers say it, `100e9` as Python reads it: the same budget."""
    from optimus.cli.plan import token_count

    assert token_count(text) == pytest.approx(tokens)


def test_a_restrictions_values_are_listed_in_numeric_order():
    """`--only dp_shard=16,2,4` is said back as 2, 4, 16 (not as text sorts them: 16, 2, 4); names alphabetically."""
    from optimus.cli.plan import sorted_values

    assert sorted_values(frozenset({"16", "2", "4"})) == "2, 4, 16"
    assert sorted_values(frozenset({"zero1", "fsdp"})) == "fsdp, zero1"


TUNE = ["tune", str(CONFIGS / "mula-tiny-moe.yaml"), "--trials", "1"]


@pytest.mark.parametrize("flags, message", [
    (["--warmup", "-1"], "--warmup must be at least 0 (got -1)"),
    (["--steps", "0"], "--steps must be at least 1 (got 0)"),
    (["--trial-timeout", "0"], "--trial-timeout must be a positive number of seconds (got 0)"),
    (["--trial-timeout", "inf"], "--trial-timeout must be a positive number of seconds (got inf)"),
])
def test_a_tune_flag_no_trial_could_run_with_is_one_line_before_any_trial(flags, message, tmp_path, capsys,
                                                                          monkeypatch):
    def measured(*args, **kwargs):
        raise AssertionError("the search went on past the flags")

    monkeypatch.setattr("optimus.cli.plan._here_cluster", measured)
    monkeypatch.setattr("optimus.plan.tune.tune", measured)
    assert main([*TUNE, *flags, "--out", str(tmp_path / "tune")]) == 2
    assert one_error_line(capsys).endswith(f"error: {message}")
    assert not (tmp_path / "tune").exists()


def test_the_trials_run_one_thread_a_rank_unless_omp_num_threads_says_otherwise(tmp_path, capsys, monkeypatch):
    """No OMP_NUM_THREADS: each trial's ranks get 1 thread (torchrun's own choice for several ranks), priced so."""
    pytest.importorskip("optuna")
    from optimus.cli.errors import UsageError

    threads = []

    def here_cluster(config, devices, calibrate, config_path, environ=None, quiet=False):
        threads.append(environ["OMP_NUM_THREADS"])
        raise UsageError("stop here")

    monkeypatch.setattr("optimus.cli.plan._here_cluster", here_cluster)
    monkeypatch.setattr("optimus.train.hardware.probe_local_accelerators", lambda: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert main([*TUNE, "--warmup", "0", "--out", str(tmp_path / "a")]) == 2
    assert one_error_line(capsys).endswith("error: stop here")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert main([*TUNE, "--out", str(tmp_path / "b")]) == 2
    assert threads == ["1", "3"] and one_error_line(capsys).endswith("error: stop here")


def test_calibrated_cluster_with_the_here_cluster_is_one_line_before_measuring(tmp_path, capsys, monkeypatch):
    """`here` keeps its calibration in its own cache: a file to write it to is refused, not silently unused."""
    def here_cluster(*args, **kwargs):
        raise AssertionError("measured before the flags were checked")

    monkeypatch.setattr("optimus.cli.plan._here_cluster", here_cluster)
    out = tmp_path / "here.yaml"
    assert main(["plan", str(CONFIGS / "mula-tiny-moe.yaml"), "--cluster", "here", "--devices", "1", "--calibrate",
                 "--calibrated-cluster", str(out)]) == 2
    assert "--calibrated-cluster names the file --calibrate writes on a GPU node" in one_error_line(capsys)
    assert not out.exists()


def test_calibrate_replaces_an_existing_cluster_file_only_with_overwrite(tmp_path, capsys, monkeypatch):
    """Checked before anything is measured (minutes on a GPU node): a calibration must not end by replacing a file
    unasked; with --overwrite it goes on to the measurement (here a stand-in that stops there)."""
    from optimus.cli.errors import UsageError

    def probe():
        raise UsageError("reached the measurement")

    monkeypatch.setattr("optimus.train.hardware.probe_local_accelerators", probe)
    out = tmp_path / "h100-calibrated.yaml"
    out.write_text("kept: true\n")
    assert main([*PLAN, "--calibrate", "--calibrated-cluster", str(out)]) == 2
    assert one_error_line(capsys).endswith(f"error: --calibrated-cluster {out} already exists: choose another file, or "
                                           "pass --overwrite to replace it")
    assert main([*PLAN, "--calibrate", "--calibrated-cluster", str(out), "--overwrite"]) == 2
    assert one_error_line(capsys).endswith("error: reached the measurement")
    assert out.read_text() == "kept: true\n"


def test_a_routing_figure_for_a_dense_model_is_refused_before_the_search(no_search, capsys):
    dense = ["plan", str(CONFIGS / "mula-tiny-dense.yaml"), "--cluster", "h100", "--devices", "8"]
    assert main([*dense, "--moe-imbalance", "1.5"]) == 2
    assert "--moe-imbalance prices an MoE's routing: this config's model is dense" in one_error_line(capsys)
