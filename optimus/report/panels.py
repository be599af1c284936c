"""The report's panels: the records of metrics.jsonl (records.py), each panel drawn as a PNG (base64) with
matplotlib's object API and the Agg canvas (no pyplot state); a panel whose metrics the run did not
log returns None and is left out of the page."""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

from optimus.report.records import MAX_RANKS_DRAWN, RunRecords, relative_loads


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _figure(height: float = 3.6, ncols: int = 1, nrows: int = 1, width: float = 9.0, top_in: float = 0.45):
    """A figure of nrows x ncols axes, `height` inches per row, with fixed margins in inches (a layout
    engine would cost more time than drawing: the report is written at the end of every run)."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, the Agg canvas by default

    total = height * nrows
    fig = Figure(figsize=(width, total))
    fig.subplots_adjust(left=0.85 / width, right=1 - 0.3 / width, bottom=0.6 / total, top=1 - top_in / total,
                        wspace=0.3, hspace=0.7)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _style(ax, title: str, ylabel: str, xlabel: str = "step") -> None:
    from matplotlib.ticker import MaxNLocator

    if xlabel == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _spread_is_wide(values: list[float]) -> bool:
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    return bool(positive) and max(positive) / min(positive) > 3


# ------------------------------------------------------------------------------------- panels
def loss_panel(records: RunRecords) -> str | None:
    steps, loss = _series(records.steps, "loss")
    if not steps:
        return None
    fig, axes = _figure()
    ax = axes[0][0]
    ax.plot(steps, loss, label="train loss", lw=1.2)
    ce_steps, ce = _series(records.steps, "ce_loss")
    if ce and ce != loss:
        ax.plot(ce_steps, ce, label="train cross-entropy", lw=0.8, alpha=0.7)
    eval_steps, eval_loss = _series(records.evals, "eval_loss")
    if eval_steps:
        ax.plot(eval_steps, eval_loss, "o-", label="held-out loss")
    if _spread_is_wide(loss + eval_loss):
        ax.set_yscale("log")
    _style(ax, "Loss and held-out loss", "loss (nats/token)")
    ax.legend()
    return _png(fig)


def downstream_panel(records: RunRecords) -> str | None:
    tasks = sorted({task for r in records.evals for task in r.get("downstream", {})})
    if not tasks:
        return None
    fig, axes = _figure()
    ax = axes[0][0]
    for index, task in enumerate(tasks):
        rows = [(r["step"], r["downstream"][task]) for r in records.evals if task in r.get("downstream", {})]
        color = f"C{index % 10}"
        ax.plot([s for s, _ in rows], [100 * x["acc"] for _, x in rows], "o-", color=color, label=f"{task} acc")
        ax.plot([s for s, _ in rows], [100 * x["acc_norm"] for _, x in rows], "s--", color=color, alpha=0.6,
                label=f"{task} acc_norm")
    _style(ax, "Downstream accuracy", "accuracy (%)")
    ax.legend(fontsize="small", ncols=2)
    return _png(fig)


def throughput_panel(records: RunRecords) -> str | None:
    steps, tokens = _series(records.steps, "tokens_per_s")
    if not steps:
        return None
    fig, axes = _figure(nrows=2, height=2.8)
    top, bottom = axes[0][0], axes[1][0]
    top.plot(steps, tokens, lw=1.0)
    _style(top, "Throughput (tokens/s, whole job)", "tokens/s")
    mfu_steps, mfu = _series(records.steps, "mfu")
    if mfu_steps:
        bottom.plot(mfu_steps, [100 * m for m in mfu], lw=1.0, color="C2")
    else:
        bottom.text(0.5, 0.5, "MFU not reported (no usable peak)", ha="center", va="center", transform=bottom.transAxes)
    _style(bottom, "MFU (model FLOPs / device peak)", "MFU (%)")
    return _png(fig)


def grad_norm_panel(records: RunRecords) -> str | None:
    steps, norms = _series(records.steps, "grad_norm")
    finite = [(s, n) for s, n in zip(steps, norms) if math.isfinite(n)]
    if not finite:
        return None
    fig, axes = _figure()
    ax = axes[0][0]
    ax.plot([s for s, _ in finite], [n for _, n in finite], lw=1.0, label="gradient norm (before clipping)")
    skipped = [r for r in records.steps if r.get("skipped") and math.isfinite(r.get("grad_norm", math.nan))]
    if skipped:
        ax.plot([r["step"] for r in skipped], [r["grad_norm"] for r in skipped], "rx", ms=8, label="skipped step")
    if _spread_is_wide([n for _, n in finite]):
        ax.set_yscale("log")
    _style(ax, "Gradient norm", "L2 norm")
    ax.legend()
    return _png(fig)


def skipped_steps_table(records: RunRecords) -> str:
    skipped = [r for r in records.steps if r.get("skipped")]
    if not skipped:
        return "<p>No optimizer step was skipped.</p>"
    rows = "".join(f"<tr><td>{r['step']}</td><td>{html.escape(str(r.get('skip_reason', '')))}</td>"
                   f"<td>{r['loss']:.4g}</td><td>{r['grad_norm']:.4g}</td></tr>" for r in skipped)
    return (f"<p>{len(skipped)} optimizer step(s) skipped.</p><table><tr><th>step</th><th>reason</th><th>loss</th>"
            f"<th>gradient norm</th></tr>{rows}</table>")


def expert_load_data(records: RunRecords) -> dict[str, Any] | None:
    """What the heatmap draws: the sampled logged steps and their expert_counts, as `counts[layer][column][expert]`."""
    loads = records.expert_loads
    if loads is None:
        return None
    return {"steps": loads.sample_steps,
            "counts": [[counts[layer].tolist() for counts in loads.sample_counts]
                       for layer in range(loads.highest.shape[1])]}


def expert_load_panels(records: RunRecords, data: dict[str, Any]) -> tuple[str, str]:
    """(max/min load per layer over training, one heatmap per layer: load of each expert at each step)."""
    import numpy as np

    # max / min per layer over every logged step (not only the sampled ones)
    loads = records.expert_loads
    layers = len(data["counts"])
    fig, axes = _figure()
    ax = axes[0][0]
    for layer in range(layers):
        color = f"C{layer % 10}"
        ax.plot(loads.steps, loads.highest[:, layer], color=color, lw=1.0, label=f"layer {layer}")
        ax.plot(loads.steps, loads.lowest[:, layer], color=color, lw=1.0, ls="--")
    ax.axhline(1.0, color="k", lw=0.6)
    _style(ax, "Expert load per layer: max (solid) and min (dashed)", "tokens / even share")
    if layers <= 12:
        ax.legend(fontsize="small", ncols=min(layers, 4))
    max_min = _png(fig)

    ncols = min(layers, 4)
    nrows = math.ceil(layers / ncols)
    fig, axes = _figure(nrows=nrows, ncols=ncols, height=2.6, width=min(4.2 * ncols, 16), top_in=0.8)
    image = None
    shown = np.stack(loads.sample_counts)  # [column, layer, expert]
    highest = float(relative_loads(shown).max())
    for layer in range(layers):
        ax = axes[layer // ncols][layer % ncols]
        grid = relative_loads(shown[:, layer]).T  # [experts, columns]
        image = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=max(highest, 1.0),
                          interpolation="nearest", extent=(-0.5, len(data["steps"]) - 0.5, -0.5, grid.shape[0] - 0.5))
        ticks = sorted({0, len(data["steps"]) // 2, len(data["steps"]) - 1})
        ax.set_xticks(ticks, [str(data["steps"][t]) for t in ticks])
        ax.set_title(f"layer {layer}", fontsize="medium")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
    for empty in range(layers, nrows * ncols):
        axes[empty // ncols][empty % ncols].set_visible(False)
    fig.suptitle("Expert load heatmap (tokens routed / even share)")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.9, pad=0.02, label="tokens / even share")
    return max_min, _png(fig)


def memory_panel(records: RunRecords) -> str | None:
    logged = [r for r in records.steps if r.get("memory_peak_gib")]
    if not logged:
        return None
    ranks = max(r.get("memory_ranks", len(r["memory_peak_gib"])) for r in logged)
    fig, axes = _figure(ncols=2, width=11)
    over_time, per_rank = axes[0][0], axes[0][1]
    steps = [r["step"] for r in logged]
    if ranks <= MAX_RANKS_DRAWN:
        for rank in range(ranks):
            over_time.plot(steps, [r["memory_peak_gib"][rank] if rank < len(r["memory_peak_gib"]) else math.nan
                                   for r in logged], lw=1.0, label=f"rank {rank}")
        over_time.legend(fontsize="small")
    else:  # records.py keeps [highest, lowest] a step for these
        over_time.plot(steps, [max(r["memory_peak_gib"]) for r in logged], label="max over ranks")
        over_time.plot(steps, [min(r["memory_peak_gib"]) for r in logged], label="min over ranks")
        over_time.legend(fontsize="small")
    source = next((r["memory_source"] for r in reversed(records.steps) if "memory_source" in r), "peak memory")
    planned = next((r["memory_planned_gib"] for r in reversed(records.steps) if "memory_planned_gib" in r), None)
    if planned is not None:  # the planner's prediction of the tensors' peak (the largest stage's): a GPU's allocated
        # peak is to match it; a CPU's resident set adds the process's own memory and what the allocator keeps
        over_time.axhline(planned, color="grey", ls="--", lw=1.0, label="planned peak of tensors per rank")
        over_time.legend(fontsize="small")
    _style(over_time, f"Peak memory over training ({source})", "GiB")
    last = records.last_memory_per_rank
    per_rank.bar(range(len(last)), last, color="C1")
    per_rank.set_xticks(range(len(last)) if len(last) <= 16 else [0, len(last) // 2, len(last) - 1])
    _style(per_rank, f"Peak memory per rank at step {logged[-1]['step']}", "GiB", xlabel="rank")
    return _png(fig)


def checkpoint_panel(records: RunRecords) -> str | None:
    if not records.checkpoints:
        return None
    fig, axes = _figure()
    ax = axes[0][0]
    steps = [r["step"] for r in records.checkpoints]
    positions = range(len(steps))
    ax.bar([p - 0.2 for p in positions], [r["checkpoint_save_s"] for r in records.checkpoints], width=0.4,
           label="save, start to commit")
    ax.bar([p + 0.2 for p in positions], [r["checkpoint_blocking_s"] for r in records.checkpoints], width=0.4,
           label="training paused")
    ax.set_xticks(list(positions), [str(s) for s in steps])
    _style(ax, "Checkpoint save time", "seconds", xlabel="checkpoint step")
    ax.legend()
    return _png(fig)


def stragglers_table(records: RunRecords) -> str | None:
    reports = [r for r in records.steps if r.get("stragglers")]
    if not reports:
        return None
    rows = "".join(
        f"<tr><td>{r['step']}</td><td>{s['rank']}</td><td>{html.escape(str(s['host']))}</td>"
        f"<td>{s['step_time_s']:.3f}</td><td>{s['median_s']:.3f}</td></tr>" for r in reports for s in r["stragglers"])
    return ("<table><tr><th>step</th><th>rank</th><th>host</th><th>step time (s)</th><th>median (s)</th></tr>"
            f"{rows}</table>")
