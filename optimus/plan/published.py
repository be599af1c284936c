"""The published figures the planner is judged against (issue 11), and the planner's prediction of each.

Every figure comes from /work/shared/REFERENCE.md (section named in `source`); the layouts the Frontier team ran
come from their own scripts (the OLCF "AI for Science at Scale, Part III" training series by the paper's first
author: launch_gpt22b_bf16.slurm, launch_gpt175b_bf16.slurm, launch_gpt1T_bf16.slurm, Megatron-DeepSpeed, read
2026-11-23). Nothing here is tuned per case: each prediction is the step-time model on the cluster preset as
shipped. benchmarks/plan_published.py prints these side by side and writes them as JSON; tests/unit/plan keep
them inside their bands.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from optimus.config import Config, load_config
from optimus.parallel.validate import validate_layout
from optimus.plan.cluster import Cluster, load_cluster
from optimus.plan.energy import PUBLISHED_TRAININGS, carbon_t
from optimus.plan.memory import ModelShape, peak_memory
from optimus.plan.step_time import StepTime, step_time

FRONTIER_SOURCE = "REFERENCE.md, Frontier (ISC 2024; abstract of arXiv 2312.12705)"
AURORA_SOURCE = "REFERENCE.md, The Aurora \"Optimus\" work (arXiv 2604.00785) and the Aurora team's own code"
LUMI_SOURCE = "REFERENCE.md, LUMI (CSC)"
SCRIPTS = "the Frontier authors' Megatron-DeepSpeed scripts (OLCF AI-for-Science training series)"


@dataclass(frozen=True)
class GptCase:
    """One Frontier model as the authors' script runs it (GPT-3 shape; TP x PP x DP, ZeRO, full recompute)."""

    name: str
    layers: int
    d_model: int
    heads: int
    seq_len: int
    global_batch: int
    tp: int
    pp: int
    dp: int
    published_of_peak: float  # "% of peak" as Megatron-DeepSpeed counts it (see megatron_of_peak)


# 22B on 2 nodes (TP 1, PP 8), 175B on 16 (TP 4, PP 16, sequence 4096), 1T on 128 (TP 4, PP 128, 200 heads):
# micro-batch 1, --checkpoint-activations, flash attention 2, ZeRO-1 (22B: ZeRO-0), global batch 640 / 640 / 1024
FRONTIER_CASES = (
    GptCase("22B", 48, 6144, 48, 2048, 640, 1, 8, 2, 0.3838),
    GptCase("175B", 96, 12288, 96, 4096, 640, 4, 16, 2, 0.3614),
    GptCase("1T", 128, 25600, 200, 2048, 1024, 4, 128, 2, 0.3196),
)
FRONTIER_STRONG_SCALING = (("175B", 8, 0.89), ("1T", 3, 0.87))  # (model, x more data-parallel replicas, published)


@dataclass
class Comparison:
    """One published figure beside the planner's, and the band the issue allows for |ours - published|."""

    case: str
    published: float
    ours: float
    band: float
    source: str
    note: str = ""
    fraction: bool = True  # the figures are fractions (print as %); False: counts, tonnes

    @property
    def met(self) -> bool:
        """Within the band."""
        return abs(self.ours - self.published) <= self.band

    def to_dict(self) -> dict[str, Any]:
        """For the JSON file."""
        return {**asdict(self), "met": self.met}


def gpt_config(case: GptCase, dp: int | None = None, global_batch: int | None = None) -> Config:
    """The case's model and layout as an Optimus config (SwiGLU with ffn = 8/3 d keeps GPT's 12 d^2 per layer; the
    trainer's zero1 stands for ZeRO-1, and for the 22B script's ZeRO-0, whose memory the comparison does not use)."""
    ffn = (8 * case.d_model // 3) // 64 * 64
    dp = dp or case.dp
    return load_config(None, [
        "--model.preset=mula-tiny-dense", f"--model.n_layers={case.layers}", f"--model.d_model={case.d_model}",
        f"--model.n_heads={case.heads}", f"--model.ffn_hidden={ffn}", "--model.n_experts=0", "--model.qk_norm=false",
        f"--train.seq_len={case.seq_len}", f"--train.global_batch_size={global_batch or case.global_batch}",
        "--train.micro_batch_size=1", "--train.dtype=bf16", "--train.activation_checkpointing=full",
        f"--parallel.tp={case.tp}", f"--parallel.pp={case.pp}", f"--parallel.dp_shard={dp}",
        "--parallel.shard_mode=zero1", "--parallel.pp_schedule=1f1b"])


def predict(config: Config, cluster: Cluster) -> tuple[StepTime, float]:
    """Step time and peak memory (bytes) of a config's own layout on `cluster`."""
    p = config.parallel
    layout = validate_layout(config, p.dp_replicate * p.dp_shard * p.tp * p.pp)
    shape = ModelShape.of(layout.config)
    return (step_time(layout.config, layout.dims, shape, cluster, None, layout.batch.micro_batches),
            peak_memory(layout.config, layout.dims, shape, cluster.host_cpu))


def megatron_of_peak(config: Config, step_s: float, cluster: Cluster) -> float:
    """Throughput as Megatron-DeepSpeed's throughput_calculator reports it, over the device peak: 24 f B s L h^2
    (1 + s / 6h + V / 16 L h) FLOPs per step with f = 4 under --checkpoint-activations (the recomputed forward
    counts), 3 without. The Frontier "% of peak" figures are this number."""
    m, t, p = config.model, config.train, config.parallel
    factor = 4 if t.activation_checkpointing != "none" else 3
    h, s, layers = m.d_model, t.seq_len, m.n_layers
    flops = 24 * factor * t.global_batch_size * s * layers * h * h * (1 + s / (6 * h) + m.vocab_size / (16 * layers * h))
    world = p.dp_replicate * p.dp_shard * p.tp * p.pp
    return flops / (step_s * world * cluster.peak_flops("bf16"))


def frontier() -> list[Comparison]:
    """38.4 / 36.1 / 32.0% of peak for 22B / 175B / 1T, each at its script's layout (band: 5 points)."""
    cluster = load_cluster("frontier")
    out = []
    for case in FRONTIER_CASES:
        config = gpt_config(case)
        time, memory = predict(config, cluster)
        ours = megatron_of_peak(config, time.step_s, cluster)
        out.append(Comparison(
            f"Frontier {case.name}: % of peak (Megatron-DeepSpeed count), TP {case.tp} x PP {case.pp} x DP {case.dp}, "
            f"{case.tp * case.pp * case.dp} GCDs", case.published_of_peak, round(ours, 4), 0.05, FRONTIER_SOURCE,
            f"layout from {SCRIPTS}; model FLOPs utilisation {time.mfu:.1%}; step {time.step_s:.1f} s; "
            f"{memory / 2**30:.0f} GiB/GCD in Optimus"))
    return out


def frontier_scaling() -> list[Comparison]:
    """89% / 87% strong scaling for 175B / 1T (band: 5 points). The abstract gives neither the sizes nor the batch:
    we scale from the script's 2 replicas to the weak-scaling size (175B: 16 replicas = 1,024 GCDs; 1T: 6 = 3,072),
    holding the global batch at the larger run's (the script's per-replica batch x its replicas)."""
    cluster = load_cluster("frontier")
    cases = {c.name: c for c in FRONTIER_CASES}
    out = []
    for name, times, published in FRONTIER_STRONG_SCALING:
        case = cases[name]
        big = case.dp * times
        batch = case.global_batch // case.dp * big
        small_s = predict(gpt_config(case, case.dp, batch), cluster)[0].step_s
        big_s = predict(gpt_config(case, big, batch), cluster)[0].step_s
        efficiency = small_s / (big_s * times)
        out.append(Comparison(
            f"Frontier {name}: strong scaling {case.tp * case.pp * case.dp} -> {case.tp * case.pp * big} GCDs "
            f"(global batch {batch} fixed)", published, round(efficiency, 4), 0.05, FRONTIER_SOURCE,
            f"sizes and batch assumed (not in the abstract); step {small_s:.1f} s -> {big_s:.1f} s"))
    return out


def lumi() -> list[Comparison]:
    """"A 140B model needs at least 5 GCDs just for its 16-bit weights" (band: exact)."""
    cluster = load_cluster("lumi")
    config = gpt_config(GptCase("140B", 80, 12288, 96, 2048, 8, 1, 1, 1, 0.0))
    weights = 2 * ModelShape.of(config).total
    gcds = -(-weights // cluster.memory_bytes)
    return [Comparison("LUMI: GCDs just to hold a 140B-class model's 16-bit weights", 5, int(gcds), 0.0, LUMI_SOURCE,
                       f"GPT-shaped 80 x 12288: {weights / 2e9:.1f}B parameters, {weights / 1e9:.0f} GB of bf16 weights "
                       f"over {cluster.memory_gb:g} GiB GCDs", fraction=False)]


def mula_220b(devices: int, global_batch: int = 3072, schedule: str = "1f1b") -> Config:
    """Mula-220B-A10B at the published layout scaled to `devices` tiles: EP 12 x PP 8, micro-batch 1, 1F1B,
    recompute of MoE + attention + norms, the EP-aware sharded optimizer with its gradients reduced in bf16 (their
    bf16 flat gradient buffers), all-gather dispatch (REFERENCE.md, the Aurora team's code: all-to-all was
    unreliable on their fabric)."""
    return load_config(None, [
        "--model.preset=mula-220b-a10b", "--train.seq_len=2048", f"--train.global_batch_size={global_batch}",
        "--train.micro_batch_size=1", "--train.dtype=bf16", "--train.activation_checkpointing=selective",
        "--train.recompute=[moe,attention,norms]", f"--parallel.dp_shard={devices // 8}", "--parallel.ep=12",
        "--parallel.pp=8", f"--parallel.pp_schedule={schedule}", "--parallel.shard_mode=zero1",
        "--parallel.ep_dispatch=allgather", "--parallel.grad_reduce_dtype=bf16"])


# what the Aurora team's code can run (REFERENCE.md, IntelLabs/Optimus-LM): no tensor parallelism, its EP-aware
# sharded optimizer (zero1 here), 1F1B, experts reached by all-gather
AURORA_CODE_ONLY = ["tp=1", "shard_mode=zero1", "pp_schedule=1f1b", "ep_dispatch=allgather"]


def _is_published_aurora_layout(config: Config) -> bool:
    p = config.parallel
    return (p.tp, p.ep, p.pp) == (1, 12, 8)


def aurora_layout() -> list[Comparison]:
    """The planner's best layout of 220B-A10B on 3,072 tiles vs the published EP 12 x PP 8 (pass: the best, or the
    best EP 12 x PP 8 layout within 5% of its step time), and where the exact published layout ranks."""
    from optimus.plan.search import parse_only, plan, within

    cluster = load_cluster("aurora")
    fitting = [c for c in plan(mula_220b(3072), cluster, 3072) if c.fits]
    best = fitting[0]
    rank, first = next((i, c) for i, c in enumerate(fitting, 1) if _is_published_aurora_layout(c.config))
    published_time, _ = predict(mula_220b(3072), cluster)
    exact = sum(c.step_s < published_time.step_s for c in fitting) + 1
    lay = best.layout()
    # and among the layouts the Aurora team's code runs: the search held there, as `optimus plan --only` holds it
    only = parse_only(AURORA_CODE_ONLY)
    theirs = [c for c in fitting if within(only, c.config.parallel.model_dump(), c.config.train.model_dump(),
                                           c.config.train.global_batch_size)]
    their_rank, their_first = next((i, c) for i, c in enumerate(theirs, 1) if _is_published_aurora_layout(c.config))
    their_best = theirs[0].layout()
    return [Comparison(
        "Aurora 220B-A10B on 3,072 tiles: best EP 12 x PP 8 layout's step time over the planner's best", 1.0,
        round(first.step_s / best.step_s, 4), 0.05, AURORA_SOURCE,
        f"planner's best: EP {lay['ep']} x PP {lay['pp']} x TP {lay['tp']} ({lay['pp_schedule']}, mbs "
        f"{lay['micro_batch_size']}, AC {lay['activation_checkpointing']}, {lay['shard_mode']}) {best.step_s:.3f} s; "
        f"first EP 12 x PP 8 at rank {rank} of {len(fitting)} fitting, {first.step_s:.3f} s; the exact published "
        f"layout (1F1B, 8 micro-batches, recompute MoE+attention+norms) {published_time.step_s:.3f} s, rank ~{exact}; "
        f"held to what their code runs (--only {' --only '.join(AURORA_CODE_ONLY)}): best EP {their_best['ep']} x PP "
        f"{their_best['pp']} {theirs[0].step_s:.3f} s, first EP 12 x PP 8 at rank {their_rank} of {len(theirs)}, "
        f"{their_first.step_s / theirs[0].step_s:.3f}x")]


def aurora_scaling() -> list[Comparison]:
    """~90% strong scaling 384 -> 12,288 tiles (band: 5 points), global batch 3,072 sequences held fixed, two ways:
    the published layout at both sizes (EP 12 x PP 8; at 12,288 tiles each rank gets 2 sequences, GPipe since 1F1B
    needs as many micro-batches as stages) and the planner's best fitting layout at each size."""
    from optimus.plan.search import plan

    cluster = load_cluster("aurora")
    small = predict(mula_220b(384), cluster)[0].step_s
    big = predict(mula_220b(12288, schedule="gpipe"), cluster)[0].step_s
    best = {n: next(c for c in plan(mula_220b(n, schedule="gpipe"), cluster, n) if c.fits) for n in (384, 12288)}
    planned = best[384].step_s * 384 / (best[12288].step_s * 12288)
    layouts = " / ".join(f"EP {b.layout()['ep']} x PP {b.layout()['pp']} x TP {b.layout()['tp']} mbs "
                         f"{b.layout()['micro_batch_size']}" for b in best.values())
    return [
        Comparison("Aurora 220B-A10B strong scaling 384 -> 12,288 tiles, published layout (EP 12 x PP 8)", 0.90,
                   round(small * 384 / (big * 12288), 4), 0.05, AURORA_SOURCE,
                   f"step {small:.2f} s -> {big:.2f} s; global batch 3,072 fixed"),
        Comparison("Aurora 220B-A10B strong scaling 384 -> 12,288 tiles, planner's best layout at each size", 0.90,
                   round(planned, 4), 0.05, AURORA_SOURCE,
                   f"step {best[384].step_s:.2f} s -> {best[12288].step_s:.2f} s; {layouts}"),
    ]


def aurora_weak_scaling() -> list[Comparison]:
    """The other reading of "~90% efficiency 384 -> 12,288 tiles": each rank keeps the published layout's 8
    sequences per step (global batch 384 -> 12,288: weak scaling), efficiency as tokens/s per tile."""
    cluster = load_cluster("aurora")
    weak_small = predict(mula_220b(384, global_batch=384), cluster)[0]
    weak_big = predict(mula_220b(12288, global_batch=12288), cluster)[0]
    return [
        Comparison("Aurora 220B-A10B 384 -> 12,288 tiles, published layout, 8 sequences per rank (weak reading)", 0.90,
                   round(weak_big.tokens_per_s / 12288 / (weak_small.tokens_per_s / 384), 4), 0.05, AURORA_SOURCE,
                   f"not the literal claim: global batch grows with the tiles; step {weak_small.step_s:.2f} s -> "
                   f"{weak_big.step_s:.2f} s"),
    ]


def energy() -> list[Comparison]:
    """LUMI's table of published trainings: our carbon arithmetic (MWh x PUE x kgCO2e/kWh) on each row's own inputs
    gives its printed tCO2e (band: the table's rounding to whole tonnes)."""
    return [Comparison(f"energy table: {name} ({hardware}) tCO2e from {mwh:,} MWh x PUE {pue} x {intensity} kgCO2e/kWh",
                       published_t, round(carbon_t(mwh, pue, intensity), 2), 0.5, LUMI_SOURCE, fraction=False)
            for name, hardware, mwh, pue, intensity, published_t in PUBLISHED_TRAININGS]


def all_comparisons(search: bool = True) -> list[Comparison]:
    """Every comparison; search=False leaves out the two that run the layout search (tens of seconds)."""
    out = energy() + lumi() + frontier() + frontier_scaling() + aurora_weak_scaling()
    return out + (aurora_layout() + aurora_scaling() if search else [])
