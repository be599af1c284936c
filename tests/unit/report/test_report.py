"""The run report: drawn from a tiny MoE run's metrics.jsonl, written at the run's end and by
`optimus report RUN`; every panel the run has metrics for, and the expert-load heatmap shows the
logged counts; bad input is one line and exit code 2."""

from __future__ import annotations

import base64
import json
import re

import pytest

from optimus.cli import main
from optimus.config import build_config
from tests.helpers.runs import tiny_run_config
from optimus.train.callbacks import JsonlMetrics, RunReport, read_metrics
from optimus.report.panels import expert_load_data
from optimus.report.records import MAX_HEATMAP_COLUMNS, RunRecords
from optimus.train.trainer import Trainer

MOE = dict(n_layers=2, n_experts=4, top_k=2, expert_ffn_hidden=32)
PANELS = ["Loss", "Downstream accuracy", "Throughput and MFU", "Gradient norm", "Skipped steps", "Expert load",
          "Expert load heatmap", "Memory per rank", "Checkpoint save time"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, small_token_dir):
    """A 4-step MoE run with a held-out evaluation and a downstream task at steps 2 and 4, checkpoints at 2 and 4."""
    run = tmp_path_factory.mktemp("moe-run")
    config = build_config(tiny_run_config(run, small_token_dir, model=MOE, train=dict(
        max_steps=4, eval_every=2, ckpt_every=2, eval_tasks=["arc_easy"], eval_tasks_limit=2)))
    Trainer(config, callbacks=[JsonlMetrics(run / "metrics.jsonl"), RunReport(run)]).fit()
    return run


def _titles_and_images(page: str) -> tuple[list[str], dict[str, bytes]]:
    titles = re.findall(r"<h2>(.*?)</h2>", page)
    images = {alt: base64.b64decode(data) for alt, data in re.findall(r'alt="(.*?)" src="data:image/png;base64,([^"]+)"', page)}
    return titles, images


def test_the_run_end_writes_a_report_with_every_panel(moe_run):
    page = (moe_run / "report.html").read_text()
    titles, images = _titles_and_images(page)
    assert titles == ["Configuration", *PANELS]
    assert set(images) == set(PANELS) - {"Skipped steps"}  # skipped steps: a table (none here)
    assert all(png.startswith(b"\x89PNG") for png in images.values())
    assert "precision: fp32 (train.dtype=fp32" in page and "No optimizer step was skipped" in page
    assert "<script src" not in page and "<link" not in page  # self-contained


def test_the_logged_metrics_the_report_needs(moe_run):
    records = RunRecords.read(moe_run / "metrics.jsonl")
    assert [r["step"] for r in records.steps] == [1, 2, 3, 4]
    for row in records.steps:
        assert len(row["memory_peak_gib"]) == 1 and row["memory_peak_gib"][0] > 0
    loads = records.expert_loads
    assert loads.steps == loads.sample_steps == [1, 2, 3, 4]
    for counts in loads.sample_counts:
        assert counts.shape == (MOE["n_layers"], 4)
        # every token goes to top_k experts in each layer: 2 sequences x 32 tokens x 2
        assert (counts.sum(axis=1) == 2 * 32 * 2).all()
    assert loads.highest.shape == loads.lowest.shape == (4, MOE["n_layers"])
    assert (loads.highest >= 1).all() and (loads.lowest <= 1).all()
    assert records.steps[0]["memory_source"] == "peak RSS"
    # the planner's prediction for the layout, logged once beside what was measured (train/memory_fit.py)
    assert 0 < records.steps[0]["memory_planned_gib"] < records.steps[0]["memory_peak_gib"][0]
    assert all("memory_planned_gib" not in r for r in records.steps[1:])
    assert [(r["step"], "arc_easy" in r["downstream"]) for r in records.evals] == [(2, True), (4, True)]
    assert [r["step"] for r in records.checkpoints] == [2, 4]
    assert all(r["checkpoint_save_s"] >= r["checkpoint_blocking_s"] > 0 for r in records.checkpoints)


def test_the_heatmap_shows_the_logged_expert_counts(moe_run):
    page = (moe_run / "report.html").read_text()
    shown = json.loads(re.search(r'<script type="application/json" id="expert-load-data">(.*?)</script>', page)[1])
    logged = [r for r in read_metrics(moe_run / "metrics.jsonl") if "expert_counts" in r]
    assert shown["steps"] == [r["step"] for r in logged]
    assert shown["counts"] == [[r["expert_counts"][layer] for r in logged] for layer in range(MOE["n_layers"])]


@pytest.mark.parametrize("logged", [7, 240, 1000, 4099])
def test_a_long_run_heatmap_samples_steps_evenly_keeping_first_and_last(tmp_path, logged):
    """Read line by line, the counts kept at most 2 x MAX_HEATMAP_COLUMNS + 1 steps at once; every step's
    busiest and idlest expert kept."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0, "expert_counts": [[s, 1], [1, 1]]}) + "\n"
                            for s in range(1, logged + 1)))
    records = RunRecords.read(path)
    data = expert_load_data(records)
    steps = data["steps"]
    assert len(steps) == min(logged, MAX_HEATMAP_COLUMNS) and steps[0] == 1 and steps[-1] == logged
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert max(gaps) <= 2 * min(gaps) + 1  # even, up to the sample's rounding
    assert data["counts"][0] == [[s, 1] for s in steps] and data["counts"][1] == [[1, 1]] * len(steps)
    assert "expert_counts" not in records.steps[0]
    loads = records.expert_loads
    assert loads.steps == list(range(1, logged + 1))
    assert loads.highest[:, 0].tolist() == [2 * s / (s + 1) for s in range(1, logged + 1)]
    assert loads.lowest[:, 1].tolist() == [1.0] * logged


def test_a_large_job_keeps_each_step_highest_and_lowest_rank_memory(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0, "memory_peak_gib": [float(s + r) for r in range(64)]} for s in (1, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = RunRecords.read(path)
    assert [r["memory_peak_gib"] for r in records.steps] == [[64.0, 1.0], [65.0, 2.0]]
    assert records.last_memory_per_rank == rows[-1]["memory_peak_gib"]
    from optimus.report.panels import memory_panel

    assert memory_panel(records)  # drawn from what was kept


def test_the_step_records_share_one_copy_of_each_key(tmp_path):
    """A parsed line's keys are its own strings, half of what a kept record takes: the kept records share them."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0, "tokens_per_s": 9.0}) + "\n" for s in (1, 2)))
    first, second = RunRecords.read(path).steps
    assert first == {"step": 1, "loss": 1.0, "tokens_per_s": 9.0} and second["step"] == 2
    assert all(a is b for a, b in zip(first, second))

def test_a_dense_run_without_evaluation_leaves_those_panels_out(tmp_path, capsys):
    rows = [{"step": s, "loss": 5.0 - s, "ce_loss": 5.0 - s, "grad_norm": 1.0, "tokens_per_s": 100.0, "mfu": None,
             "skipped": s == 2, **({"skip_reason": "non-finite"} if s == 2 else {})} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().out.strip() == f"report: {tmp_path / 'r.html'}"
    titles, images = _titles_and_images((tmp_path / "r.html").read_text())
    assert titles == ["Loss", "Throughput and MFU", "Gradient norm", "Skipped steps"]
    assert "1 optimizer step(s) skipped" in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize("make, problem", [
    (lambda tmp: tmp / "missing", "is not a directory"),
    (lambda tmp: tmp, "holds no metrics.jsonl"),
])
def test_bad_run_dir_is_one_line_and_exit_2(tmp_path, capsys, make, problem):
    assert main(["report", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("optimus report: error:") and problem in err[0]


@pytest.mark.parametrize("config, problem", [
    (b"model: [unclosed\n", "config.yaml' is not valid YAML at line 2"),
    (b"\xff\xfe", "config.yaml' is not UTF-8 text (byte 0)"),
    (b"- a list\n", "config.yaml' is not a mapping of config sections"),
    (b"model: 3\n", "config.yaml' is not a mapping of config sections"),
])
def test_a_damaged_config_yaml_is_one_line_and_exit_2(tmp_path, capsys, config, problem):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "config.yaml").write_bytes(config)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("optimus report: error:") and problem in err[0], err
    assert "move it away" in err[0] and not (tmp_path / "report.html").exists()


def test_the_panels_draw_what_was_logged(tmp_path, monkeypatch):
    """Read off the figures themselves: the held-out curve is the evaluations' eval_loss at their steps, and each
    layer's heatmap is [expert, step] of the logged counts over their even share (3 experts, 2 layers, 3 steps:
    a transposed image would be [step, expert])."""
    import numpy as np

    from optimus.report import panels

    counts = {1: [[6, 0, 0], [1, 1, 1]], 2: [[0, 6, 0], [2, 1, 0]], 3: [[3, 3, 0], [0, 0, 3]]}
    lines = [{"step": s, "loss": 5.0 - s, "expert_counts": c} for s, c in counts.items()]
    lines += [{"step": 2, "eval_loss": 4.5}, {"step": 3, "eval_loss": 4.25}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = RunRecords.read(path)
    figures = []
    monkeypatch.setattr(panels, "_png", lambda fig: figures.append(fig) or "png")
    panels.loss_panel(records)
    (held_out,) = [line for line in figures[0].axes[0].get_lines() if line.get_label() == "held-out loss"]
    assert list(held_out.get_xdata()) == [2, 3] and list(held_out.get_ydata()) == [4.5, 4.25]
    panels.expert_load_panels(records, panels.expert_load_data(records))
    heatmaps = [ax.get_images()[0].get_array() for ax in figures[-1].axes if ax.get_images()]
    assert len(heatmaps) == 2
    for layer, shown in enumerate(heatmaps):
        logged = np.array([counts[s][layer] for s in (1, 2, 3)], dtype=float)  # [step, expert]
        want = (logged / logged.mean(axis=1, keepdims=True)).T  # [expert, step]
        np.testing.assert_allclose(np.asarray(shown), want)


def test_the_summary_names_the_last_held_out_loss(tmp_path):
    """The report's headline gives where the run ended: the held-out loss of the last evaluation, not the first."""
    from optimus.report.page import render_report

    lines = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3, 4)]
    lines += [{"step": 2, "eval_loss": 4.5}, {"step": 4, "eval_loss": 4.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert "last loss 1.0000, last held-out loss 4.2500</p>" in render_report(tmp_path)


def test_the_precision_line_comes_from_the_newest_run_segment(tmp_path):
    """A run resumed with another dtype or on other devices logs its precision again: the report states what the
    run trains with now (the newest segment's line), not what it started with."""
    from optimus.report.page import precision_line

    def segment(step, dtype, devices):
        return {"step": step, "loss": 1.0, "dtype": dtype, "dtype_requested": "auto", "dtype_reason": "why",
                "peak_flops_per_device": 1e12, "peak_source": "table", "world_size": devices}

    lines = [segment(1, "fp32", 1), {"step": 2, "loss": 1.0}, segment(3, "bf16", 8), {"step": 4, "loss": 1.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    line = precision_line(RunRecords.read(path))
    assert line.startswith("precision: bf16 (train.dtype=auto; why)") and line.endswith("8 device(s)")


def test_the_heatmap_keeps_the_last_step_after_a_damaged_line(tmp_path):
    """A damaged expert_counts line (ragged) makes the log hold fewer readable steps than counted: the heatmap of
    a long run still ends at the run's last step, where the user looks first."""
    logged = 2 * MAX_HEATMAP_COLUMNS
    lines = [{"step": s, "loss": 1.0, "expert_counts": [[s, 1], [1, 1]]} for s in range(1, logged + 1)]
    lines[10]["expert_counts"] = [[1, 2], [3]]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = RunRecords.read(path)
    assert len(records.expert_loads.steps) == logged - 1 and 11 not in records.expert_loads.steps
    steps = expert_load_data(records)["steps"]
    assert steps[0] == 1 and steps[-1] == logged and len(steps) <= MAX_HEATMAP_COLUMNS


def test_an_expert_counts_line_with_another_layer_count_is_skipped(tmp_path):
    """A line whose expert_counts has another number of layers than the run's (a damaged or foreign line) is left
    out of the expert-load panels; the report is still drawn rather than failing on it."""
    lines = [{"step": s, "loss": 1.0, "expert_counts": [[s, 1], [1, 1]]} for s in (1, 2, 3)]
    lines[1]["expert_counts"] = [[1, 1], [1, 1], [1, 1]]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    loads = RunRecords.read(path).expert_loads
    assert loads.steps == [1, 3] and loads.highest.shape == (2, 2)
    assert [counts.shape for counts in loads.sample_counts] == [(2, 2), (2, 2)]


def test_a_job_of_exactly_max_ranks_drawn_keeps_every_rank_memory(tmp_path):
    """Up to MAX_RANKS_DRAWN ranks the memory panel draws one line per rank: a job of exactly that many keeps each
    rank's peak, not only the highest and lowest."""
    from optimus.report.records import MAX_RANKS_DRAWN

    memory = [float(rank + 1) for rank in range(MAX_RANKS_DRAWN)]
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 1.0, "memory_peak_gib": memory}) + "\n")
    (step,) = RunRecords.read(path).steps
    assert step["memory_peak_gib"] == memory and "memory_ranks" not in step


def test_the_configuration_summary_states_the_model_batch_schedule_layout_and_tasks():
    """The rows a reader needs first, from config.yaml's sections: only the layout degrees above 1, the words a
    missing micro-batch or evaluation interval stands for, and the downstream tasks where the run has some."""
    from optimus.report.page import config_summary

    config = {"model": {"preset": "mula-tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_experts": 8, "top_k": 2,
                        "vocab_size": 100},
              "train": {"global_batch_size": 8, "seq_len": 32, "micro_batch_size": None, "max_steps": 10,
                        "ckpt_every": 5, "eval_every": 0, "dtype": "bf16", "eval_tasks": ["arc_easy", "piqa"]},
              "optim": {"lr": 0.001, "min_lr": 0.0001, "schedule": "wsd", "warmup_steps": 2, "weight_decay": 0.1,
                        "grad_clip": 1.0},
              "parallel": {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 4, "shard_mode": "fsdp"},
              "data": {"sources": [{"name": "web"}, {"path": "/data/code"}]}}
    assert dict(config_summary(config)) == {
        "model": "mula-tiny: 2 layers, d_model 64, 4 heads, MoE, 8 experts, top-2, vocabulary 100",
        "batch": "8 sequences of 32 tokens per step (micro-batch derived)",
        "steps": "10 (checkpoint every 5, evaluation every run end)",
        "optimizer": "AdamW lr 0.001 -> 0.0001 (wsd, 2 warm-up steps), weight decay 0.1, clip 1.0",
        "dtype": "bf16", "layout": "dp_shard=2, ep=4", "data": "web, /data/code", "downstream tasks": "arc_easy, piqa"}
    dense = {"model": {"n_experts": 0, "top_k": 2}, "train": {"micro_batch_size": 2, "eval_every": 50},
             "parallel": {"dp_shard": 1, "tp": 1}, "data": {"recipe": "mula"}}
    rows = dict(config_summary(dense))
    assert "dense" in rows["model"] and "MoE" not in rows["model"] and "(micro-batch 2)" in rows["batch"]
    assert rows["steps"].endswith("evaluation every 50)") and rows["layout"] == "one replica"
    assert rows["data"] == "mula" and "downstream tasks" not in rows


def test_the_headline_gives_the_tokens_seen_with_thousands_separators_and_the_peak_in_tflops(tmp_path):
    from optimus.report.page import render_report

    line = {"step": 3, "loss": 2.0, "tokens_seen": 1234567, "dtype": "bf16", "dtype_requested": "bf16",
            "dtype_reason": "asked", "peak_flops_per_device": 989.5e12, "peak_source": "H100 table", "world_size": 8}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    page = render_report(tmp_path)
    assert "step 3 of ?, 1,234,567 tokens seen, last loss 2.0000</p>" in page
    assert ("precision: bf16 (train.dtype=bf16; asked); peak for MFU: 989.5 TFLOP/s per device (H100 table); "
            "8 device(s)") in page


def test_a_curve_goes_logarithmic_only_past_a_threefold_spread_of_its_positive_finite_values():
    from optimus.report.panels import _spread_is_wide

    assert not _spread_is_wide([1.0, 3.0]) and _spread_is_wide([1.0, 3.01])
    assert not _spread_is_wide([0.0, -2.0, 1.0, 2.0, float("nan"), float("inf")])  # zeros, negatives, nan left out
    assert _spread_is_wide([0.0, 1.0, 4.0]) and not _spread_is_wide([0.0, -1.0])


def _figures_of(monkeypatch):
    from optimus.report import panels

    figures = []
    monkeypatch.setattr(panels, "_png", lambda fig: figures.append(fig) or "png")
    return panels, figures


def _records(tmp_path, lines):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return RunRecords.read(path)


def test_the_loss_panel_draws_the_cross_entropy_only_where_it_differs_from_the_loss(tmp_path, monkeypatch):
    """A dense run's loss is its cross-entropy (one curve); an MoE's adds the router losses (two)."""
    panels, figures = _figures_of(monkeypatch)
    for ce_offset in (0.0, 0.1):
        panels.loss_panel(_records(tmp_path, [{"step": s, "loss": 3.0 - s / 10, "ce_loss": 3.0 - s / 10 - ce_offset}
                                              for s in (1, 2)]))
    labels = [[line.get_label() for line in fig.axes[0].get_lines()] for fig in figures]
    assert labels == [["train loss"], ["train loss", "train cross-entropy"]]


def test_the_gradient_norm_panel_marks_only_the_skipped_steps(tmp_path, monkeypatch):
    panels, figures = _figures_of(monkeypatch)
    lines = [{"step": s, "loss": 1.0, "grad_norm": float(s), "skipped": s == 3} for s in (1, 2, 3, 4)]
    panels.grad_norm_panel(_records(tmp_path, lines))
    (marks,) = [line for line in figures[0].axes[0].get_lines() if line.get_label() == "skipped step"]
    assert list(marks.get_xdata()) == [3] and list(marks.get_ydata()) == [3.0]


def test_the_skipped_steps_and_straggler_tables_give_their_numbers_at_a_fixed_precision():
    from optimus.report.panels import skipped_steps_table, stragglers_table

    records = RunRecords(steps=[
        {"step": 2, "loss": 1.23456, "grad_norm": 12345.678, "skipped": True, "skip_reason": "non-finite <loss>"},
        {"step": 5, "loss": 1.0, "stragglers": [{"rank": 3, "host": "<n1>", "step_time_s": 1.23456,
                                                  "median_s": 0.5}]}])
    assert "<tr><td>2</td><td>non-finite &lt;loss&gt;</td><td>1.235</td><td>1.235e+04</td></tr>" in (
        skipped_steps_table(records))
    assert "<tr><td>5</td><td>3</td><td>&lt;n1&gt;</td><td>1.235</td><td>0.500</td></tr>" in stragglers_table(records)


@pytest.mark.parametrize("layers, legend", [(12, True), (13, False)])
def test_the_expert_load_panel_has_a_legend_up_to_twelve_layers(tmp_path, monkeypatch, layers, legend):
    panels, figures = _figures_of(monkeypatch)
    records = _records(tmp_path, [{"step": s, "loss": 1.0, "expert_counts": [[2, 1]] * layers} for s in (1, 2)])
    panels.expert_load_panels(records, panels.expert_load_data(records))
    assert (figures[0].axes[0].get_legend() is not None) == legend


@pytest.mark.parametrize("ranks, ticks", [(16, list(range(16))), (17, [0, 8, 16])])
def test_the_memory_per_rank_bars_name_every_rank_up_to_sixteen(tmp_path, monkeypatch, ranks, ticks):
    panels, figures = _figures_of(monkeypatch)
    panels.memory_panel(_records(tmp_path, [{"step": 1, "loss": 1.0, "memory_peak_gib": [1.0] * ranks}]))
    assert list(figures[0].axes[1].get_xticks()) == ticks
