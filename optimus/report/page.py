"""The run report: one self-contained HTML page (plots embedded as PNG) drawn from a run directory's
metrics.jsonl and config.yaml: `optimus report RUN`, and written at the end of every run.

Panels: loss and held-out loss, downstream accuracies, tokens/s and MFU, gradient norm, skipped
steps, the routers' load per MoE layer (max/min over training and the full distribution as a
heatmap), each rank's peak memory, checkpoint save times, straggler reports. A panel whose metrics
the run did not log (no MoE, no evaluation, ...) is left out. The expert-load heatmap's numbers are
also embedded as JSON (id "expert-load-data"), exactly as drawn.
"""

from __future__ import annotations

import html
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from optimus.atomic_write import write_text_whole
from optimus.config import YamlFileError, read_yaml
from optimus.report.panels import (
    checkpoint_panel, downstream_panel, expert_load_data, expert_load_panels, grad_norm_panel, loss_panel,
    memory_panel, skipped_steps_table, stragglers_table, throughput_panel,
)
from optimus.report.records import RunRecords

REPORT_FILE = "report.html"


class ReportError(ValueError):
    """A run directory a report cannot be drawn from; the message is one line with the fix."""


def precision_line(records: RunRecords) -> str | None:
    """The run's precision and MFU peak, as the trainer printed them (from the newest run segment)."""
    first = next((r for r in reversed(records.steps) if "dtype" in r), None)
    if first is None:
        return None
    how = "train.dtype=auto" if first["dtype_requested"] == "auto" else f"train.dtype={first['dtype_requested']}"
    return (f"precision: {first['dtype']} ({how}; {first['dtype_reason']}); peak for MFU: "
            f"{first['peak_flops_per_device'] / 1e12:.4g} TFLOP/s per device ({first['peak_source']}); "
            f"{first['world_size']} device(s)")


def read_run_config(path: Path) -> dict[str, Any]:
    """The run's config.yaml as a mapping of sections ({} where the run has none), or ReportError in one line: a
    damaged file is named rather than drawn half (the trainer writes it whole; an edit may not have)."""
    if not path.is_file():
        return {}
    fix = "restore it (the config the run was started with), or move it away to draw the report without it"
    try:
        config = read_yaml(path) or {}
    except YamlFileError as err:
        raise ReportError(f"'{path}' {err.problem}: {fix}") from None
    if not isinstance(config, dict) or not all(isinstance(section, dict) for section in config.values()):
        raise ReportError(f"'{path}' is not a mapping of config sections (model, train, ...): {fix}")
    return config


def config_summary(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(setting, value) rows a reader needs first: the model, batch, schedule, layout and data."""
    model, train = config.get("model", {}), config.get("train", {})
    optim, parallel, data = config.get("optim", {}), config.get("parallel", {}), config.get("data", {})
    kind = f"MoE, {model.get('n_experts')} experts, top-{model.get('top_k')}" if model.get("n_experts") else "dense"
    layout = ", ".join(f"{k}={v}" for k, v in parallel.items() if isinstance(v, int) and v > 1) or "one replica"
    sources = data.get("recipe") or ", ".join(
        str(s.get("name") or s.get("path") or s.get("glob")) for s in data.get("sources", []))
    rows = [
        ("model", f"{model.get('preset') or 'custom'}: {model.get('n_layers')} layers, d_model {model.get('d_model')}, "
                  f"{model.get('n_heads')} heads, {kind}, vocabulary {model.get('vocab_size')}"),
        ("batch", f"{train.get('global_batch_size')} sequences of {train.get('seq_len')} tokens per step "
                  f"(micro-batch {train.get('micro_batch_size') or 'derived'})"),
        ("steps", f"{train.get('max_steps')} (checkpoint every {train.get('ckpt_every')}, evaluation every "
                  f"{train.get('eval_every') or 'run end'})"),
        ("optimizer", f"AdamW lr {optim.get('lr')} -> {optim.get('min_lr')} ({optim.get('schedule')}, "
                      f"{optim.get('warmup_steps')} warm-up steps), weight decay {optim.get('weight_decay')}, "
                      f"clip {optim.get('grad_clip')}"),
        ("dtype", str(train.get("dtype"))),
        ("layout", layout),
        ("data", sources),
    ]
    if train.get("eval_tasks"):
        rows.append(("downstream tasks", ", ".join(train["eval_tasks"])))
    return rows


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
h1{margin-bottom:0.2em}h2{border-bottom:1px solid #ddd;padding-bottom:0.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ddd;padding:0.25em 0.6em;text-align:left}
img{max-width:100%}.muted{color:#666}pre{background:#f6f6f6;padding:0.8em;overflow-x:auto;font-size:85%}"""


def render_report(run_dir: str | Path) -> str:
    """The report of `run_dir` as one self-contained HTML page; ReportError when it cannot be drawn."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ReportError(f"'{run}' is not a directory: pass the run.dir of a training run")
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"'{run}' holds no metrics.jsonl: pass the run.dir of a training run that logged a step")
    records = RunRecords.read(metrics)
    if not records.steps:
        raise ReportError(f"'{metrics}' holds no logged training step yet: train first (optimus train ...)")
    config_path = run / "config.yaml"
    config = read_run_config(config_path)

    sections: list[str] = []

    def panel(title: str, image: str | None, note: str = "") -> None:
        if image is not None:
            sections.append(f"<h2>{html.escape(title)}</h2>{note}<img alt=\"{html.escape(title)}\" "
                            f"src=\"data:image/png;base64,{image}\">")

    panel("Loss", loss_panel(records))
    panel("Downstream accuracy", downstream_panel(records))
    panel("Throughput and MFU", throughput_panel(records))
    panel("Gradient norm", grad_norm_panel(records))
    sections.append(f"<h2>Skipped steps</h2>{skipped_steps_table(records)}")
    data = expert_load_data(records)
    if data is not None:
        max_min, heatmap = expert_load_panels(records, data)
        panel("Expert load", max_min, "<p class=muted>tokens routed to an expert / an even share (1.0 = balanced); "
                                      "summed over the step's global batch</p>")
        panel("Expert load heatmap", heatmap)
        sections.append(f"<script type=\"application/json\" id=\"expert-load-data\">{json.dumps(data)}</script>")
    panel("Memory per rank", memory_panel(records))
    panel("Checkpoint save time", checkpoint_panel(records))
    stragglers = stragglers_table(records)
    if stragglers is not None:
        sections.append(f"<h2>Straggler reports</h2>{stragglers}")

    last = records.steps[-1]
    name = (config.get("run") or {}).get("name") or run.name
    summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                      for k, v in config_summary(config)) if config else ""
    precision = precision_line(records)
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [f"<h1>Run report: {html.escape(str(name))}</h1>",
            f"<p class=muted>{html.escape(str(run.resolve()))}; generated {generated}</p>",
            f"<p>step {last['step']} of {(config.get('train') or {}).get('max_steps', '?')}, "
            f"{last.get('tokens_seen', 0):,} tokens seen, last loss {last['loss']:.4f}"
            + (f", last held-out loss {records.evals[-1]['eval_loss']:.4f}"
               if records.evals and "eval_loss" in records.evals[-1] else "") + "</p>"]
    if precision:
        head.append(f"<p><code>{html.escape(precision)}</code></p>")
    if summary:
        head.append(f"<h2>Configuration</h2><table>{summary}</table><details><summary>config.yaml</summary>"
                    f"<pre>{html.escape(config_path.read_text())}</pre></details>")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Optimus report: {html.escape(str(name))}"
            f"</title><style>{_CSS}</style></head><body>{''.join(head)}{''.join(sections)}</body></html>\n")


def write_report(run_dir: str | Path, out: str | Path | None = None, overwrite: bool = False) -> Path:
    """Render the report of `run_dir` into `out` (default RUN/report.html), written whole or not at all.

    The default file is the report's own and is rewritten freely (the trainer does at every run end); any other
    existing `out` is replaced only with `overwrite` (`--out RUN/config.yaml` must not turn the run's config into HTML).
    """
    own = Path(run_dir) / REPORT_FILE
    path = Path(out) if out is not None else own
    page = render_report(run_dir)  # first: a run folder that is not one is named as such
    if not path.parent.is_dir():
        raise ReportError(f"cannot write '{path}': its folder does not exist; create it or choose another --out")
    if path.exists() and not overwrite and path.resolve() != own.resolve():
        raise ReportError(f"--out {out} already exists: choose another file, or pass --overwrite to replace it")
    write_text_whole(path, page)
    return path
