"""Enumerate the layouts of a job, keep those the trainer accepts (validate_layout), predict and rank them.

Candidates: every tp (dividing the heads, at most one node), pp (dividing the layers' count into stages),
ep (dividing the experts and dp_shard), dp_shard as all data-parallel ranks or as HSDP groups of a node's
size, each micro-batch size dividing a rank's share (powers of two up to 16), activation checkpointing
none / selective (the config's mask) / selective_ops / full, shard_mode fsdp / zero1 / zero2 / ddp (HSDP groups only under fsdp;
ddp only where validation allows it: no tp, pp or ep), pp_schedule 1f1b / gpipe / interleaved_1f1b (2 virtual
stages) when pp > 1, and ep_dispatch all_to_all / allgather when ep > 1. Every candidate goes through the ONE
validation function the trainer uses, so the planner never proposes a layout the trainer rejects.

A search can be held to part of that space (`optimus plan --only tp=1 --only shard_mode=zero1`: what a stack
without tensor parallelism runs, or a user's own constraints): `parse_only` reads the restrictions, `plan` skips
every variant outside them before pricing it.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from dataclasses import dataclass, replace
from typing import Any

from optimus.config import Config, ConfigError
from optimus.parallel.mesh import LayoutError, ParallelDims
from optimus.parallel.validate import divisors, validate_layout
from optimus.plan.cluster import Cluster
from optimus.plan.comms import placement
from optimus.parallel.dry_run import HEADROOM
from optimus.plan.energy import run_cost  # noqa: F401 (also importable from here, as before)
from optimus.plan.memory import ModelShape, peak_stage_memory
from optimus.plan.routing import Routing, layout_imbalance
from optimus.plan.efficiency import Efficiency
from optimus.plan.step_time import step_time

GIB = 1024**3
# the largest --devices planned: over a hundred times today's largest machines (Frontier: 75,264 GCDs)
MAX_DEVICES = 10_000_000
# a search of more layouts than this is priced by forked workers, one per core (at most MAX_WORKERS), in runs of
# CHUNK layouts: pricing is pure Python, and 74,388 layouts of 220B-A10B on 768 Aurora tiles took 68 s on one core of
# a 2-core EPYC; a small search prices faster than the workers start
FORK_ABOVE, CHUNK, MAX_WORKERS = 4_000, 500, 32
# what a candidate sets, and nothing else: the config keys a planned layout is written as (report.write_best_config)
# and run with (tune.layout_overrides)
PLANNED_KEYS = {"parallel": ("dp_replicate", "dp_shard", "tp", "pp", "ep", "shard_mode", "pp_schedule",
                             "pp_virtual_stages", "ep_dispatch"),
                "train": ("micro_batch_size", "activation_checkpointing")}


@dataclass
class Candidate:
    """One layout, whether it fits, and what it is predicted to do."""

    config: Config  # validated, micro-batch resolved
    fits: bool
    memory_bytes: float
    step_s: float
    tokens_per_s: float
    mfu: float
    parts: dict[str, float]
    # MoE: the busiest expert shard's share priced (its activations' in the worst pipeline stage, its GEMMs')
    moe_imbalance: tuple[float, float] | None = None
    # memory_bytes by term (memory.stage_memory's, of the stage that peaks): parameters, gradients, activations, ...
    memory_parts: dict[str, float] | None = None

    def layout(self) -> dict[str, Any]:
        """The layout keys of the JSON entry."""
        p, t = self.config.parallel, self.config.train
        return {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp, "pp": p.pp, "ep": p.ep,
                "micro_batch_size": t.micro_batch_size,
                "grad_accum": t.global_batch_size // (p.dp_replicate * p.dp_shard * t.micro_batch_size),
                "activation_checkpointing": t.activation_checkpointing + (
                    f" ({'+'.join(t.recompute)})" if t.activation_checkpointing == "selective" else ""),
                "shard_mode": p.shard_mode, "ep_dispatch": p.ep_dispatch if p.ep > 1 else "none",
                "pp_schedule": p.pp_schedule if p.pp > 1 else "none",
                "pp_virtual_stages": p.pp_virtual_stages}

    def entry(self, cluster: Cluster, tokens: float | None) -> dict[str, Any]:
        """The JSON entry: layout, fit, memory, time, and with a token budget the days, energy and CO2."""
        out: dict[str, Any] = {"layout": self.layout(), "fits": self.fits, "memory_gib": self.memory_bytes / GIB,
                               "step_time_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                               "step_parts_s": self.parts, "placement": placement(self.dims(), cluster)}
        if self.memory_parts is not None:
            out["memory_parts_gib"] = {term: value / GIB for term, value in self.memory_parts.items()}
        if self.moe_imbalance is not None:
            out["moe_imbalance"] = dict(zip(("memory", "step_time"), self.moe_imbalance))
        if tokens:
            out.update(run_cost(cluster, self.config_world(), self.tokens_per_s, tokens))
        return out

    def dims(self) -> ParallelDims:
        """The layout's degrees."""
        p = self.config.parallel
        return ParallelDims.from_config(p, self.config_world())

    def config_world(self) -> int:
        """Devices of the layout (the product of its degrees)."""
        p = self.config.parallel
        return p.dp_replicate * p.dp_shard * p.tp * p.pp


# the --json layout keys a search may be held to, and the values the categorical ones take
ONLY_CHOICES: dict[str, tuple[str, ...] | None] = {
    "dp_replicate": None, "dp_shard": None, "tp": None, "pp": None, "ep": None, "micro_batch_size": None,
    "grad_accum": None, "activation_checkpointing": ("none", "selective", "selective_ops", "full"),
    "shard_mode": ("fsdp", "zero1", "zero2", "ddp"), "pp_schedule": ("1f1b", "gpipe", "interleaved_1f1b"),
    "ep_dispatch": ("all_to_all", "allgather"),
}


def parse_only(specs: list[str]) -> dict[str, frozenset[str]]:
    """`KEY=V1,V2` restrictions (one per key; integer keys take positive integers) -> {key: allowed values}.
    ConfigError naming the one that cannot be read, and what would be."""
    only: dict[str, frozenset[str]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        allowed = [v.strip() for v in values.split(",") if v.strip()]
        if key not in ONLY_CHOICES or not sep or not allowed:
            raise ConfigError(f"--only {spec!r}: write KEY=V1[,V2...] with KEY one of {', '.join(ONLY_CHOICES)}")
        choices = ONLY_CHOICES[key]
        bad = [v for v in allowed if not (v in choices if choices else v.isdigit() and int(v) > 0)]
        if bad:
            kinds = ", ".join(choices) if choices else "positive integers"
            raise ConfigError(f"--only {key}: {bad[0]!r} is not a value it takes ({kinds})")
        if key in only:
            raise ConfigError(f"--only {key} is given twice: list its values once, comma-separated")
        only[key] = frozenset(str(int(v)) if not choices else v for v in allowed)
    return only


def within(only: dict[str, frozenset[str]], parallel: dict, train: dict, global_batch: int) -> bool:
    """Whether a variant (or a planned config's parallel and train sections, dumped) keeps to the restrictions. A schedule restriction holds where there is a pipeline (pp >
    1) and a dispatch restriction where there is expert parallelism (ep > 1): elsewhere neither has a value."""
    dp = parallel["dp_replicate"] * parallel["dp_shard"]
    values = {**parallel, **train, "grad_accum": global_batch // (dp * train["micro_batch_size"])}
    for key, allowed in only.items():
        if (key == "pp_schedule" and parallel["pp"] == 1) or (key == "ep_dispatch" and parallel["ep"] == 1):
            continue
        if str(values[key]) not in allowed:
            return False
    return True


def _variants(config: Config, devices: int, cluster: Cluster):
    m, train = config.model, config.train
    for tp in [t for t in divisors(devices) if t <= cluster.devices_per_node and m.n_heads % t == 0]:
        for pp in [q for q in divisors(devices // tp) if q <= m.n_layers]:
            dp = devices // (tp * pp)
            for ep in [e for e in divisors(dp) if e == 1 or (m.is_moe and m.n_experts % e == 0)]:
                # how tokens reach their experts matters only with ep > 1: both ways then
                dispatches = ("all_to_all", "allgather") if ep > 1 else (config.parallel.ep_dispatch,)
                node_group = max(ep, cluster.devices_per_node // tp)
                shards = {dp} | ({node_group} if dp % node_group == 0 and node_group % ep == 0 else set())
                for dp_shard in sorted(shards):
                    # zero and ddp span all data-parallel ranks whatever the grouping: enumerate them once
                    # (with one data-parallel rank the modes differ in nothing: one row)
                    modes = ("fsdp", "zero1", "zero2", "ddp") if dp_shard == dp > 1 else ("fsdp",)
                    if train.global_batch_size % dp:
                        continue
                    per_rank = train.global_batch_size // dp
                    for mbs in [b for b in (1, 2, 4, 8, 16) if per_rank % b == 0]:
                        for ac in ONLY_CHOICES["activation_checkpointing"]:
                            for mode, dispatch in itertools.product(modes, dispatches):
                                for sched, virtual in ((("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2))
                                                       if pp > 1 else (("1f1b", 1),)):
                                    yield dict(dp_replicate=dp // dp_shard, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep,
                                               shard_mode=mode, pp_schedule=sched, pp_virtual_stages=virtual,
                                               ep_dispatch=dispatch), \
                                        dict(micro_batch_size=mbs, activation_checkpointing=ac)


@dataclass(frozen=True)
class _Pricing:
    """Prices one variant of a job's layouts: its Candidate, or None where validate_layout rejects it."""

    config: Config
    shape: ModelShape  # the config's
    cluster: Cluster
    devices: int
    efficiency: Efficiency | None
    routing: Routing

    def __call__(self, variant: tuple[dict, dict]) -> Candidate | None:
        config = self.config
        candidate = _variant_config(config, variant)
        try:
            layout = validate_layout(candidate, self.devices)
        except LayoutError:
            return None
        shape, cluster = self.shape, self.cluster
        kept, paced = layout_imbalance(self.routing, layout.config, layout.dims)
        memory_parts = peak_stage_memory(layout.config, layout.dims, shape, cluster.host_cpu, kept)
        memory = sum(memory_parts.values())
        time = step_time(layout.config, layout.dims, shape, cluster, self.efficiency, layout.batch.micro_batches,
                         paced)
        priced = (max(kept.values()) if isinstance(kept, dict) else kept, paced) if config.model.is_moe else None
        return Candidate(layout.config, memory <= cluster.memory_bytes * HEADROOM, memory, time.step_s,
                         time.tokens_per_s, time.mfu, time.parts, priced, memory_parts)


def _variant_config(config: Config, variant: tuple[dict, dict]) -> Config:
    parallel, train = variant
    return config.model_copy(update={"parallel": config.parallel.model_copy(update=parallel),
                                     "train": config.train.model_copy(update=train)})


_FORKED: tuple[_Pricing, list] | None = None  # what forked workers price: set before the fork, inherited


def _price_run(bounds: tuple[int, int]) -> list[tuple[int, Candidate] | None]:
    """(a forked worker) its run of variants priced, each as (the micro-batch it resolved to, its Candidate without
    the config): a config crosses a pipe 50 times slower than it is rebuilt (pydantic)."""
    pricing, variants = _FORKED
    priced = (pricing(variant) for variant in variants[bounds[0]:bounds[1]])
    return [None if c is None else (c.config.train.micro_batch_size, replace(c, config=None)) for c in priced]


def pricing_workers(variants: int) -> int:
    """Forked workers a search of `variants` layouts is priced on: 1 (this process) for a small one, or where
    this platform cannot fork."""
    if (variants <= FORK_ABOVE or "fork" not in multiprocessing.get_all_start_methods()
            or multiprocessing.current_process().daemon):  # (a pool's own worker may not start processes)
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS, -(-variants // CHUNK)))


def _price_all(pricing: _Pricing, variants: list, workers: int) -> list[Candidate | None]:
    """Each variant priced, in order: here, or over `workers` forked processes in runs of CHUNK."""
    global _FORKED
    if workers <= 1:
        return [pricing(v) for v in variants]
    _FORKED = (pricing, variants)
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            runs = pool.map(_price_run, [(i, i + CHUNK) for i in range(0, len(variants), CHUNK)], chunksize=1)
    finally:
        _FORKED = None
    priced = (result for run in runs for result in run)
    return [None if r is None else
            replace(r[1], config=_variant_config(pricing.config, (v[0], {**v[1], "micro_batch_size": r[0]})))
            for v, r in zip(variants, priced)]


def plan(config: Config, cluster: Cluster, devices: int, efficiency: Efficiency | None = None,
         only: dict[str, frozenset[str]] | None = None, routing: Routing = 1.0,
         workers: int | None = None) -> list[Candidate]:
    """Every valid layout of `config` on `devices` devices of `cluster`, fitting ones first, fastest first.

    efficiency: per op class; None takes the cluster's own (preset defaults, or the calibration here).
    only: restrictions from parse_only (none: the whole space).
    routing: an MoE's busiest expert shard's token copies over its balanced share (1: balanced), or a run's logged
    routing split as each layout splits the experts (plan/routing.py), priced in its activations and its expert
    GEMMs' time.
    workers: processes pricing the layouts (None: pricing_workers); the ranking is the same on any number.
    """
    if devices < 1:
        raise ConfigError(f"--devices must be at least 1 (got {devices})")
    if devices > MAX_DEVICES:
        raise ConfigError(f"--devices {devices} is more than the {MAX_DEVICES:,} devices the planner searches: "
                          "ask for a machine that exists")
    if devices % cluster.devices_per_node:
        raise ConfigError(f"--devices {devices} is not a multiple of the {cluster.devices_per_node} devices per "
                          f"{cluster.name} node: ask for whole nodes")
    config = cluster.resolved(config)  # train.dtype "auto" as the trainer resolves it on this cluster's devices
    variants = [(parallel, train) for parallel, train in _variants(config, devices, cluster)
                if not only or within(only, parallel, train, config.train.global_batch_size)]
    workers = pricing_workers(len(variants)) if workers is None else workers
    pricing = _Pricing(config, ModelShape.of(config), cluster, devices, efficiency, routing)
    out = [c for c in _price_all(pricing, variants, workers) if c]
    out.sort(key=lambda c: (not c.fits, c.step_s))
    return out
