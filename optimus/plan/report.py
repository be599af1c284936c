"""The planner's outputs: the ranked table, the JSON list, and the best layout as a config file."""

from __future__ import annotations

import json
from pathlib import Path

from optimus.atomic_write import write_text_whole
from optimus.config import Config, config_yaml
from optimus.plan.cluster import Cluster
from optimus.plan.energy import energy_table
from optimus.plan.routing import LoggedRouting
from optimus.plan.scaling import SmallerRun
from optimus.plan.search import PLANNED_KEYS, Candidate

DISPATCH_LABEL = {"all_to_all": "a2a", "allgather": "ag", "none": "-"}  # parallel.ep_dispatch, short


def format_table(candidates: list[Candidate], cluster: Cluster, devices: int, top: int,
                 tokens: float | None) -> str:
    """The `top` best layouts as plain text, one per line, with the energy columns when a token budget is given."""
    head = (f"{'#':>3} {'dp_r':>5} {'dp_s':>5} {'tp':>3} {'pp':>3} {'ep':>3} {'mbs':>4} {'acc':>4} "
            f"{'ckpt':<26} {'shard':<6} {'disp':<4} {'sched':<17} {'GiB':>6} {'fits':>4} {'step s':>8} {'tok/s':>11} "
            f"{'MFU':>6}")
    if tokens:
        head += f" {'days':>7} {'MWh':>8} {'tCO2e':>7}"
    lines = [f"{len(candidates)} valid layouts of {devices} {cluster.name} devices "
             f"({sum(c.fits for c in candidates)} fit {cluster.memory_label} at 90%); "
             f"best {min(top, len(candidates))}:",
             head]
    for rank, c in enumerate(candidates[:top], 1):
        lay = c.layout()
        sched = lay["pp_schedule"] + (f" v{lay['pp_virtual_stages']}" if lay["pp_virtual_stages"] > 1 else "")
        # with one data-parallel rank nothing is sharded or replicated: the mode does not apply
        shard = lay["shard_mode"] if lay["dp_replicate"] * lay["dp_shard"] > 1 else "-"
        line = (f"{rank:>3} {lay['dp_replicate']:>5} {lay['dp_shard']:>5} {lay['tp']:>3} {lay['pp']:>3} {lay['ep']:>3} "
                f"{lay['micro_batch_size']:>4} {lay['grad_accum']:>4} {lay['activation_checkpointing']:<26.26} "
                f"{shard:<6} {DISPATCH_LABEL[lay['ep_dispatch']]:<4} {sched:<17} "
                f"{c.memory_bytes / 1024**3:>6.1f} {'yes' if c.fits else 'NO':>4} "
                f"{c.step_s:>8.3f} {c.tokens_per_s:>11,.0f} {c.mfu:>6.1%}")
        if tokens:
            cost = c.entry(cluster, tokens)
            line += f" {cost['days']:>7.2f} {cost['energy_mwh']:>8.1f} {cost['co2_t']:>7.1f}"
        lines.append(line)
    best = next((c for c in candidates if c.fits), None)
    # the best that fits; where none does, the one that comes closest: what it would take to fit
    shown = best or min(candidates, key=lambda c: c.memory_bytes, default=None)
    if shown is not None:
        lines += breakdown(shown, candidates.index(shown) + 1)
    if tokens:
        lines.append(f"energy: nodes x {cluster.node_power_kw:g} kW x time (IT energy); carbon = MWh x PUE "
                     f"{cluster.pue:g} x {cluster.grid_kgco2_per_kwh:g} kgCO2e/kWh (cluster preset '{cluster.name}')")
        if best is not None:
            cost = best.entry(cluster, tokens)
            label = f"this plan: {token_text(tokens)} tokens, {cost['days']:.1f} days"
            hardware = f"{devices} x {cluster.device}"
            lines += ["", "energy and carbon beside published trainings (LUMI's table, REFERENCE.md):",
                      energy_table([(label, hardware, cost["energy_mwh"], cost["pue"], cost["kgco2_per_kwh"],
                                     cost["co2_t"])])]
    return "\n".join(lines)


def token_text(tokens: float) -> str:
    """A token budget as `--tokens` takes it and papers write it: 100B, 2.5T, 6.3M."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.4g}{suffix}"  # 4 digits: 999.5B stays 999.5B, not 1e+03B
    return f"{tokens:.3g}"


def breakdown(candidate: Candidate, rank: int) -> list[str]:
    """Where layout #`rank`'s memory and step time go: its terms, largest first (what a plan that does not fit, or
    runs slower than hoped, asks first)."""
    def terms(parts: dict[str, float], scale: float, unit: str, places: int) -> str:
        shown = [(name, value / scale) for name, value in parts.items() if round(value / scale, places)]
        return ", ".join(f"{name} {value:.{places}f}{unit}" for name, value in sorted(shown, key=lambda t: -t[1]))

    lines = []
    if candidate.memory_parts:
        stage = " (its fuller pipeline stage, first or last)" if candidate.config.parallel.pp > 1 else ""
        lines.append(f"#{rank} memory per device{stage}, {candidate.memory_bytes / 1024**3:.1f} GiB: "
                     + terms(candidate.memory_parts, 1024**3, " GiB", 1))
    lines.append(f"#{rank} step, {candidate.step_s:.3f} s: " + terms(candidate.parts, 1.0, " s", 3))
    return lines


def write_json(path: str | Path, candidates: list[Candidate], cluster: Cluster, tokens: float | None,
               devices: int | None = None, baseline: SmallerRun | None = None) -> None:
    """The ranked list, one entry per layout (see Candidate.entry); with a smaller run to scale from, each entry's
    `scaling_efficiency` against it (its tokens/s per device over the smaller run's best)."""
    entries = [c.entry(cluster, tokens) for c in candidates]
    if baseline is not None and baseline.best is not None and devices:
        for entry, candidate in zip(entries, candidates):
            entry["scaling_efficiency"] = baseline.efficiency(candidate, devices)
    # one layout a line: grep and head find whole layouts in a search of tens of thousands (and 11% fewer bytes)
    # whole or not at all: an empty file left by a full disk would make the rerun ask for --overwrite
    write_text_whole(path, "[\n" + ",\n".join(json.dumps(entry) for entry in entries) + "\n]\n")


def layout_summary(candidate: Candidate) -> str:
    """A layout in one phrase: its degrees, micro-batch, checkpointing, shard mode and schedule."""
    lay = candidate.layout()
    degrees = " x ".join(f"{key} {lay[key]}" for key in ("dp_replicate", "dp_shard", "tp", "pp", "ep") if lay[key] > 1)
    schedule = f", {lay['pp_schedule']}" if lay["pp"] > 1 else ""
    shard = f", {lay['shard_mode']}" if lay["dp_replicate"] * lay["dp_shard"] > 1 else ""  # nothing to shard over
    return (f"{degrees or 'one device'} (mbs {lay['micro_batch_size']}, AC {lay['activation_checkpointing']}"
            f"{shard}{schedule})")


def describe_scaling(baseline: SmallerRun, best: Candidate, devices: int) -> str:
    """One line: the best layout's scaling efficiency over the smaller run, or why there is none."""
    held = "global batch held at" if baseline.scaling == "strong" else "global batch scaled to"
    if best is not None and not best.fits:
        return f"scaling: no layout of {devices} devices fits: none to score against a smaller run"
    if baseline.best is None:
        return (f"scaling: no layout of {baseline.devices} devices fits ({held} {baseline.global_batch_size} "
                f"sequences): no smaller run to compare with")
    mine, theirs = best.tokens_per_s / devices, baseline.best.tokens_per_s / baseline.devices
    return (f"{baseline.scaling} scaling from {baseline.devices} to {devices} devices: {mine / theirs:.1%} of linear "
            f"({mine:,.0f} against {theirs:,.0f} tokens/s per device; {held} {baseline.global_batch_size} sequences "
            f"on {baseline.devices}, whose best layout is {layout_summary(baseline.best)})")


def write_best_config(path: str | Path, best: Candidate, original: Config) -> None:
    """The best layout as a config file: the user's config with the planned parallel and train keys."""
    config = original.model_copy(update={
        section: getattr(original, section).model_copy(update={k: getattr(getattr(best.config, section), k)
                                                               for k in keys})
        for section, keys in PLANNED_KEYS.items()})
    write_text_whole(path, config_yaml(config))


def describe_routing(routing: LoggedRouting, best: Candidate) -> str:
    """What the logged routing gives the best layout (each layout is priced at its own expert split)."""
    dims = best.dims()
    kept, paced = routing.shares(best.config, dims)
    said = (f"priced at the routing {routing.source} logged (its last {routing.steps} logged steps), split as each "
            f"layout splits the experts; ")
    if dims.ep * dims.tp == 1:
        return said + "the best layout's ranks each hold every expert (ep x tp = 1): none waits for another's"
    return said + (f"the busiest of the best layout's {dims.ep * dims.tp} expert shards (ep x tp) {paced:.2f}x its "
                   f"even share of a layer's token copies on average, its activations at {max(kept.values()):.2f}x "
                   f"in the worst step")
