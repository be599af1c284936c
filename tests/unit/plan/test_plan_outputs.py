"""`optimus plan --json/--write-config` and `optimus tune --out`: an existing output is refused before the search,
unless --overwrite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optimus.cli import main
from optimus.config import ConfigError, load_config
from optimus.plan.tune import TrialRun, tune
from tests.helpers.runs import one_error_line

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
PLAN = ["plan", str(CONFIGS / "mula-tiny-moe.yaml"), "--cluster", "h100", "--devices", "8", "--top", "1"]


@pytest.fixture
def no_search(monkeypatch):
    """Fail the test if the layout search starts: the outputs are checked first."""
    def search(*args, **kwargs):
        raise AssertionError("the search ran before the outputs were checked")

    monkeypatch.setattr("optimus.plan.search.plan", search)
    monkeypatch.setattr("optimus.plan.tune.tune", search)


@pytest.mark.parametrize("flag", ["--json", "--write-config"])
def test_plan_refuses_an_existing_output_before_searching(tmp_path, flag, no_search, capsys):
    out = tmp_path / "mine.txt"
    out.write_text("keep me")
    assert main([*PLAN, flag, str(out)]) == 2
    assert one_error_line(capsys).endswith(f"error: {flag} {out} already exists: choose another file, or pass "
                                            "--overwrite to replace it")
    assert out.read_text() == "keep me"


@pytest.mark.parametrize("flag", ["--json", "--write-config"])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_plan_refuses_writing_over_the_config_it_plans(tmp_path, flag, overwrite, no_search, capsys):
    """Even with --overwrite: the user's own config (its comments, its other keys) is never the output."""
    config = tmp_path / "model.yaml"
    config.write_text((CONFIGS / "mula-tiny-moe.yaml").read_text())
    argv = [*PLAN[:1], str(config), *PLAN[2:], flag, str(config), *overwrite]
    assert main(argv) == 2
    assert one_error_line(capsys).endswith(f"error: {flag} {config} is the config being planned: write to another "
                                            "file")
    assert config.read_text() == (CONFIGS / "mula-tiny-moe.yaml").read_text()


def test_plan_refuses_one_file_for_both_outputs(tmp_path, no_search, capsys):
    out = tmp_path / "both"
    assert main([*PLAN, "--json", str(out), "--write-config", str(out)]) == 2
    assert one_error_line(capsys).endswith(f"error: --json and --write-config both name {out}: give each its own file")
    assert not out.exists()


def test_plan_with_overwrite_replaces_both_outputs(tmp_path):
    out, best = tmp_path / "plan.json", tmp_path / "best.yaml"
    out.write_text("old")
    best.write_text("old")
    assert main([*PLAN, "--json", str(out), "--write-config", str(best), "--overwrite"]) == 0
    assert json.loads(out.read_text())
    assert load_config(best).parallel


def test_a_plan_output_cut_short_leaves_nothing_to_overwrite(tmp_path, monkeypatch, capsys):
    """A disk that fills while --json is written left an empty file, and the rerun after freeing space was refused
    ("already exists"): the outputs are written under a temporary name and renamed into place whole."""
    import errno

    out, best = tmp_path / "plan.json", tmp_path / "best.yaml"
    real_write_text = Path.write_text

    def disk_full(path, text, *args, **kwargs):
        real_write_text(path, text[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    assert main([*PLAN, "--json", str(out), "--write-config", str(best)]) == 2
    assert "No space left on device" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert main([*PLAN, "--json", str(out), "--write-config", str(best)]) == 0  # no --overwrite needed
    assert json.loads(out.read_text()) and load_config(best).parallel


@pytest.mark.parametrize("held", [["trials.jsonl"], ["best.yaml"], ["trials.jsonl", "best.yaml"]])
def test_tune_refuses_a_folder_holding_an_earlier_search_before_any_trial(tmp_path, held, no_search, capsys):
    for name in held:
        (tmp_path / name).write_text("earlier\n")
    argv = ["tune", str(CONFIGS / "mula-tiny-moe.yaml"), "--trials", "1", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert one_error_line(capsys).endswith(f"error: --out {tmp_path} already holds an earlier search "
                                            f"({', '.join(held)}): choose another --out, or pass --overwrite to "
                                            "replace it")
    assert all((tmp_path / name).read_text() == "earlier\n" for name in held)


def _tiny_cluster():
    from optimus.plan.here import here_cluster

    fit = {"alpha_us": 200.0, "beta_gb_s": 1.0, "worst_relative_error": 0.1}
    machine = {"cpu": "test CPU", "cores": 2, "memory_bytes": 64 * 1024**3, "fp32_flops_per_thread": 2e10,
               "bf16_flops_per_thread": 2e8, "auto_dtype": "fp32", "copy_gb_s_one_thread": 8.0,
               "copy_gb_s_all_cores": 10.0, "collectives": {"timing": "mean call", "rows": [], "fits": {"2": fit}},
               "measured_at": "test"}
    return here_cluster({"machine": machine}, 2)


def test_tune_replaces_an_earlier_search_only_with_overwrite(tmp_path):
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64", "--model.n_layers=2"])
    (tmp_path / "trials.jsonl").write_text("earlier\n")
    (tmp_path / "best.yaml").write_text("earlier\n")

    def failing_run(config_path, overrides, candidate, ranks, steps, warmup, env, timeout_s):
        return TrialRun("failed: test")

    def search(overwrite: bool):
        return tune(config, "unused.yaml", [], _tiny_cluster(), 2, 1, tmp_path, {}, runner=failing_run,
                    say=lambda line: None, overwrite=overwrite)

    with pytest.raises(ConfigError, match="already holds an earlier search"):
        search(overwrite=False)
    assert (tmp_path / "trials.jsonl").read_text() == "earlier\n"
    best, records = search(overwrite=True)
    assert best is None and "earlier" not in (tmp_path / "trials.jsonl").read_text()
    assert not (tmp_path / "best.yaml").exists()  # no stale best beside the new trials


@pytest.mark.parametrize("value, config, message", [
    ("0.5", "mula-tiny-moe.yaml", "--moe-imbalance is the busiest rank's token copies over its balanced share: a "
                                  "number of at least 1 (got 0.5)"),
    ("nan", "mula-tiny-moe.yaml", "a number of at least 1 (got nan)"),
    ("1.5", "mula-tiny-dense.yaml", "--moe-imbalance prices an MoE's routing: this config's model is dense"),
])
def test_plan_refuses_a_routing_imbalance_it_cannot_price(value, config, message, no_search, capsys):
    argv = ["plan", str(CONFIGS / config), "--cluster", "h100", "--devices", "8", "--moe-imbalance", value]
    assert main(argv) == 2
    assert message in one_error_line(capsys)


def test_plan_prices_the_routing_imbalance_it_is_given(tmp_path, capsys):
    """The busiest rank's extra token copies cost its activations and its expert GEMMs' time, where ep or tp split
    the experts (not its peak where a recompute replays the experts after the loss head's larger buffers are
    freed); layouts whose ranks hold every expert are unchanged."""
    runs = {}
    for imbalance in ("1", "1.5"):
        out = tmp_path / f"plan-{imbalance}.json"
        assert main([*PLAN, "--moe-imbalance", imbalance, "--json", str(out)]) == 0
        runs[imbalance] = {json.dumps(e["layout"], sort_keys=True): e for e in json.loads(out.read_text())}
    assert "busiest expert-holding rank 1.5x" in capsys.readouterr().out
    grew, held = {"memory_gib": 0, "step_time_s": 0}, 0
    for key, balanced in runs["1"].items():
        skewed, layout = runs["1.5"][key], balanced["layout"]
        for field in grew:
            if layout["ep"] * layout["tp"] > 1:
                assert skewed[field] >= balanced[field], (layout, field)
                grew[field] += skewed[field] > balanced[field]
            else:
                assert skewed[field] == balanced[field], (layout, field)
        held += layout["ep"] * layout["tp"] == 1
    assert grew["memory_gib"] > 100 and grew["step_time_s"] > 100 and held, (grew, held)
