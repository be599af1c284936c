"""Step time of a layout: compute from FLOPs, collectives by alpha-beta, the pipeline bubble, and what overlaps.

    compute      FLOPs per token by op class (dense GEMM, grouped expert GEMM, attention scores), plus the
                 forward FLOPs activation checkpointing recomputes, over peak x efficiency of that class,
                 split evenly over tp x pp (ep moves tokens to experts, it does not change FLOPs per rank);
                 a GEMM class takes at least the time its weights need to stream from HBM (roofline: 3
                 passes per micro-batch, 4 when recomputed), which is what makes experts that see few
                 tokens each memory bound
    per micro-batch, not overlapped: tp (sequence parallel: all-gather + reduce-scatter of the block's
                 activations before/after attention and MLP, forward and backward, again when recomputed),
                 ep dispatch and combine (all-to-all, or all-gather + reduce-scatter), pp sends of
                 activations and their gradients
    per micro-batch, overlapped with compute: FSDP's parameter all-gathers (forward and backward) and
                 gradient reduce-scatter (fp32); only what exceeds the micro-batch's compute is exposed
    bubble       (m + (pp - 1) / v) micro-batch times for m micro-batches, pp stages, v virtual stages:
                 a bubble fraction of (pp - 1) / (m + pp - 1) for 1F1B and GPipe, divided by v interleaved
    per step, not overlapped: the gradient all-reduce over dp_replicate (FSDP/HSDP), zero1/zero2's gradient
                 reduce-scatter and parameter all-gather, and the AdamW update (memory bound: 30 bytes of
                 HBM traffic per owned element)

Efficiency: the fraction of the datasheet peak a large GEMM reaches. Default 0.80, from the one measured
anchor we have (REFERENCE.md: ~790 of 989 TFLOP/s bf16 dense matmul on H100); grouped GEMM and attention
use it too until they are calibrated. Override per class with Efficiency(...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optimus.config import Config
from optimus.models.flops import ParameterCount, flops_per_token
from optimus.parallel.mesh import ParallelDims
from optimus.plan.cluster import Cluster
from optimus.plan.comms import all_reduce_time, all_to_all_time, group_link, p2p_time, ring_time
from optimus.plan.memory import ModelShape

DEFAULT_EFFICIENCY = 0.80  # REFERENCE.md: H100 ~790 TFLOP/s measured bf16 dense matmul / 989.4 datasheet
ADAMW_BYTES_PER_ELEMENT = 30  # read master, grad, 2 moments (16 B); write master, 2 moments (12 B), bf16 param (2 B)


@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak FLOP/s each op class reaches."""

    dense_gemm: float = DEFAULT_EFFICIENCY
    grouped_gemm: float = DEFAULT_EFFICIENCY
    attention: float = DEFAULT_EFFICIENCY


@dataclass
class StepTime:
    """One step's predicted time and its parts (seconds), and what it yields."""

    step_s: float
    parts: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    bubble_fraction: float = 0.0


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Share of a pipelined step the stages sit idle: ((pp - 1) / v) / (m + (pp - 1) / v)."""
    if pp <= 1:
        return 0.0
    idle = (pp - 1) / virtual_stages
    return idle / (micro_batches + idle)


def _flops_by_class(config: Config, shape: ModelShape) -> dict[str, float]:
    """Training FLOPs per token (6 x matmul parameters, 12 L d S for attention scores), by op class."""
    m, seq = config.model, config.train.seq_len
    layers = shape.n_layers
    active_experts = shape.block_experts * m.top_k // m.n_experts if m.is_moe else 0
    return {
        "attention_proj": 6.0 * layers * shape.block_attention,
        "mlp": 6.0 * layers * (shape.block_tp_split - shape.block_attention + shape.block_replicated),
        "head": 6.0 * shape.head,
        "experts": 6.0 * layers * active_experts,
        "attention": 12.0 * layers * m.d_model * seq,
    }


def _recomputed_flops(config: Config, by_class: dict[str, float]) -> dict[str, float]:
    """Forward FLOPs (a third of training FLOPs) that activation checkpointing runs again, by class."""
    mode = config.train.activation_checkpointing
    block = ("attention_proj", "mlp", "experts", "attention")
    if mode == "full":
        chosen = block
    elif mode == "selective":
        recompute = set(config.train.recompute)
        chosen = (("attention_proj", "attention") if "attention" in recompute else ()) + \
                 (("mlp", "experts") if recompute & {"moe", "mlp"} else ())
    else:  # none; ops recomputes only norms and activation functions (no matmuls)
        chosen = ()
    return {c: by_class[c] / 3.0 for c in chosen}


def step_time(config: Config, dims: ParallelDims, shape: ModelShape, cluster: Cluster,
              efficiency: Efficiency = Efficiency(), micro_batches: int = 1) -> StepTime:
    """Predict one optimizer step of `config` (validated, micro-batch resolved) laid out as `dims`."""
    train, p = config.train, config.parallel
    dtype = "fp32" if train.dtype == "fp32" else "bf16"
    width = 2 if dtype == "bf16" else 4
    peak = cluster.peak_flops(dtype)
    h = config.model.d_model
    tokens_mb = train.micro_batch_size * train.seq_len
    by_class = _flops_by_class(config, shape)
    recomputed = _recomputed_flops(config, by_class)
    rate = {"attention_proj": efficiency.dense_gemm, "mlp": efficiency.dense_gemm, "head": efficiency.dense_gemm,
            "experts": efficiency.grouped_gemm, "attention": efficiency.attention}
    flop_s = {c: tokens_mb * (by_class[c] + recomputed.get(c, 0.0)) / (dims.tp * dims.pp) / (peak * rate[c])
              for c in by_class}
    layers = -(-shape.n_layers // dims.pp)
    # roofline: a GEMM cannot run faster than its weights stream from HBM, read in the forward, read for the
    # input gradient and written as the weight gradient (3 passes), once more when recomputed; this is what
    # makes experts that see few tokens each (small ep, small micro-batches) memory bound
    hbm = cluster.hbm_gb_s * 1e9
    dense_weights = layers * (shape.block_tp_split / dims.tp + shape.block_replicated) + shape.head / dims.pp
    expert_weights = layers * shape.block_experts / dims.ep
    dense_passes = 3 + (1 if recomputed.get("attention_proj") or recomputed.get("mlp") else 0)
    expert_passes = 3 + (1 if recomputed.get("experts") else 0)
    dense_s = max(flop_s["attention_proj"] + flop_s["mlp"] + flop_s["head"], dense_passes * width * dense_weights / hbm)
    expert_s = max(flop_s["experts"], expert_passes * width * expert_weights / hbm) if expert_weights else 0.0
    compute_mb = dense_s + expert_s + flop_s["attention"]

    act_bytes = tokens_mb * h * width
    attn_again = 1 if recomputed.get("attention") else 0
    mlp_again = 1 if (recomputed.get("mlp") or recomputed.get("experts")) else 0
    tp_mb = 0.0
    if dims.tp > 1:  # per layer: (all-gather + reduce-scatter) around attention and MLP, forward and backward
        tp_link = group_link(dims, ("tp",), cluster)
        passes = 2 * 2 + 2 * (attn_again + mlp_again)
        tp_mb = layers * passes * ring_time(tp_link, act_bytes)
    ep_mb = 0.0
    if dims.ep > 1:  # per MoE layer: dispatch + combine, forward, backward, and again when recomputed
        ep_link = group_link(dims, ("ep",), cluster)
        exchanges = 2 * (2 + mlp_again)
        if p.ep_dispatch == "all_to_all":
            one = all_to_all_time(ep_link, act_bytes * config.model.top_k / dims.tp, cluster)
        else:  # all-gather the tokens over ep, reduce-scatter the outputs: each moves ep x the local tokens
            one = ring_time(ep_link, dims.ep * act_bytes / dims.tp)
        ep_mb = layers * exchanges * one
    pp_mb = 0.0
    if dims.pp > 1:  # activations forward, their gradients backward, one send each per micro-batch
        pp_link = group_link(dims, ("pp",), cluster)
        beta = pp_link.beta if pp_link.size == pp_link.per_node else cluster.inter_node_gb_s * 1e9 / cluster.devices_per_node
        pp_mb = 2 * p2p_time(pp_link.alpha, beta, act_bytes / dims.tp)

    # parameters of one stage, gathered over the data-parallel dims (still split over tp and ep)
    root = shape.embedding / dims.tp + shape.head if dims.pp == 1 else max(shape.embedding / dims.tp, shape.head)
    dense_stage = layers * (shape.block_tp_split / dims.tp + shape.block_replicated) + root
    expert_stage = layers * shape.block_experts / dims.ep
    fsdp_mb = step_sync = 0.0
    dp_link = group_link(dims, ("dp_replicate", "dp_shard_mod_ep", "ep"), cluster)
    expert_dp_link = group_link(dims, ("dp_replicate", "dp_shard_mod_ep"), cluster)
    if p.shard_mode == "fsdp":
        shard_link = group_link(dims, ("dp_shard_mod_ep", "ep"), cluster)
        expert_link = group_link(dims, ("dp_shard_mod_ep",), cluster)
        # two all-gathers in the compute dtype and one fp32 reduce-scatter per micro-batch
        fsdp_mb = (2 * width + 4) * (ring_time(shard_link, dense_stage) + ring_time(expert_link, expert_stage))
        if dims.dp_replicate > 1:
            rep_link = group_link(dims, ("dp_replicate",), cluster)
            step_sync = all_reduce_time(rep_link, 4 * (dense_stage / dims.dp_shard + expert_stage / dims.dp_shard_mod_ep))
        owned = dense_stage / dims.dp_shard + expert_stage / dims.dp_shard_mod_ep
    else:  # zero1/zero2: reduce-scatter the gradients, all-gather the updated parameters, once per step
        dense_link = dp_link if p.ep_aware else expert_dp_link
        step_sync = 2 * width * (ring_time(dense_link, dense_stage) + ring_time(expert_dp_link, expert_stage))
        owned = dense_stage / (dims.dp if p.ep_aware else dims.dp_replicate * dims.dp_shard_mod_ep) + \
            expert_stage / (dims.dp_replicate * dims.dp_shard_mod_ep)
    optimizer = owned * ADAMW_BYTES_PER_ELEMENT / (cluster.hbm_gb_s * 1e9)

    exposed_fsdp = max(0.0, fsdp_mb - compute_mb)
    per_mb = compute_mb + tp_mb + ep_mb + pp_mb + exposed_fsdp
    virtual = p.pp_virtual_stages if dims.pp > 1 else 1
    bubble = bubble_fraction(dims.pp, micro_batches, virtual)
    pipeline = per_mb * micro_batches / (1 - bubble)
    step = pipeline + step_sync + optimizer
    tokens = train.global_batch_size * train.seq_len
    active = shape.total - (shape.n_layers * (shape.block_experts - shape.block_experts * config.model.top_k
                                               // config.model.n_experts) if config.model.is_moe else 0)
    model_flops = flops_per_token(ParameterCount(shape.total, active, shape.embedding), config.model, train.seq_len)
    mfu = model_flops * tokens / (step * dims.world_size * peak)
    parts = {"compute": compute_mb * micro_batches, "tp": tp_mb * micro_batches, "ep": ep_mb * micro_batches,
             "pp_p2p": pp_mb * micro_batches, "fsdp_exposed": exposed_fsdp * micro_batches,
             "bubble": pipeline * bubble, "dp_sync": step_sync, "optimizer": optimizer}
    return StepTime(step, parts, tokens / step, mfu, bubble)
