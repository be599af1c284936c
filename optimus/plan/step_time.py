"""Step time of a layout: compute from FLOPs, collectives by alpha-beta, the pipeline bubble, and what overlaps.

    compute      FLOPs per token by op class (dense GEMM, grouped expert GEMM, attention scores), plus the
                 forward FLOPs activation checkpointing recomputes, over peak x efficiency of that class, for the
                 slowest pipeline stage (the last: ceil(L / pp) blocks split over tp, plus the whole LM head);
                 ep moves tokens to experts, it does not change FLOPs per rank;
                 a GEMM class takes at least the time its weights need to stream from HBM (roofline: 3
                 passes per micro-batch, 4 when recomputed), which is what makes experts that see few
                 tokens each memory bound
    per micro-batch, not overlapped: tp (sequence parallel: all-gather + reduce-scatter of the block's
                 activations before/after attention and MLP, forward and backward; QK-norm's all-reduces; the
                 embedding's, LM head's and loss's collectives), ep dispatch and combine (all-to-all after the
                 forward's exchange of per-expert counts, or all-gather of the tokens + reduce-scatter of their
                 combined outputs), and of each what the recompute runs again (replayed_collectives, counted per
                 checkpointing mode): block_collectives.py
    per micro-batch, overlapped with compute: data parallelism's gradient and parameter collectives where they run
                 beside a backward or a micro-batch (FSDP's gathers and reduce-scatters, HSDP's all-reduces:
                 data_parallel_time.py says which and when) and pp sends of activations and gradients
                 (asynchronous, 2 per virtual stage); only what exceeds the micro-batch's compute is exposed, all of
                 it on a cluster whose collectives cannot run beside compute (`here`: gloo on the ranks' own cores).
                 Filling and draining the pipe waits for 2 (pp - 1) sends
    buffer copies data parallelism's copies in and out of its communication buffers (data_parallel_time.py):
                 memory-bound work on the rank, never hidden
    collectives  optimus/plan/comms.py: each group placed on the node hierarchy, hierarchical or flat rings
    bubble       the last stage (LM head) runs its m micro-batches back to back; filling and draining the pipe
                 add (pp - 1) / v micro-batch times of a stage without the head (pp stages, v virtual stages: the
                 textbook (pp - 1) / (m + pp - 1) fraction for 1F1B and GPipe when the stages are equal);
                 where ranks outnumber cores (`here`, core_share = cores / ranks < 1), the idle ranks' cores serve
                 the busy ones (work-conserving), so the step is max(the stages' average busy time, that critical
                 path x core_share)
    memory bound per micro-batch: norms, SwiGLU, residual adds, RoPE and routing permutes (bytes counted in
                 memory_bound_bytes as fused kernels move them, times eager_memory_traffic unless train.compile
                 fuses them; the expert path's own kernels move the fused count either way), over hbm_gb_s x
                 memory_bound (`here`: the rank's cores' bandwidth, Cluster.core_bandwidth_gb_s, not its part of
                 the socket's); the loss's softmax over the vocabulary is
                 part of the loss_head class (the LM head's FLOPs at its own efficiency); under tp the
                 vocab-parallel loss's further passes over its logits are memory bound (VOCAB_PARALLEL_EXTRA_BYTES)
    weight passes per micro-batch: autocast's bf16 copies of fp32 weights and of their gradients back, and the
                 accumulation of each micro-batch's gradients after the first, whole where a rank keeps them so
                 (one process, tp or pp alone, ddp, zero1, FSDP deferring its reduce-scatter), into fp32 shards
                 where FSDP reduces every micro-batch (weight_pass_bytes; zero2's sums are among its buffer
                 copies), at the optimizer class's rate
    op overhead  a fixed cost per operator launched (op_overhead_us x operators per micro-batch; calibrated on a
                 CPU; on the h100/h200 presets what an H200 left exposed of its host's launches, on the other GPU
                 presets, which model fused published stacks, zero; a compiled block counts a tenth of its
                 operators), and under tp what DTensor's dispatch adds per DTensor operator (dtensor_overhead_us x
                 dtensor_cost.dtensor_operators; zero on the GPU presets)
    per micro-batch, zero2: its gradient reduce-scatter, less the 2/3 of the micro-batch's compute (its
                 backward) that hides it
    per step, not overlapped: data parallelism's collectives after the last backward (data_parallel_time.py:
                 FSDP's and HSDP's under pp, the zero modes' reductions and parameter gathers, ddp's all-reduce
                 beyond the backward that hides it), and the gradient clipping with the AdamW update (42 bytes of
                 HBM traffic per owned element, at the optimizer class's rate: one fused in-place pass, which on a
                 CPU streams at about twice a copy's bandwidth and is bound by the rank's cores, not the socket:
                 Cluster.core_bandwidth_gb_s), and the step's own small collectives (the loss,
                 the clipping's norm, the callbacks' figures: step_collectives.py)

Efficiency (optimus/plan/efficiency.py): the fraction of peak each op class reaches; by default the cluster
preset's `efficiency:` block, or what `optimus plan --calibrate` measured for `--cluster here`; where a node's
calibration tabulated the compute classes by the rows a call runs (by_rows), at this layout's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from optimus.config import Config
from optimus.models.flops import ParameterCount, flops_per_token
from optimus.parallel.activation_memory import weights_stay_fp32
from optimus.parallel.mesh import ParallelDims
from optimus.plan.cluster import Cluster
from optimus.plan.block_collectives import (TensorParallelGaps, expert_parallel_time, replayed_collectives,
                                            tensor_parallel_time)
from optimus.plan.comms import group_link, send_time, sync_after_compute  # noqa: F401 (re-exported)
from optimus.plan.data_parallel_time import data_parallel_time
from optimus.plan.dtensor_cost import dtensor_operators
from optimus.plan.efficiency import DEFAULT_EFFICIENCY, Efficiency, call_rows  # noqa: F401 (Efficiency re-exported)
from optimus.plan.memory import ModelShape
from optimus.plan.step_collectives import step_collectives_time

ADAMW_BYTES_PER_ELEMENT = 30  # read master, grad, 2 moments (16 B); write master, 2 moments (12 B), bf16 param (2 B)
# gradient clipping (train/step.py, optim/sharded.py): the norm reads each fp32 gradient, the scale by the clip
# coefficient (torch applies it whatever the norm) reads and writes it again
CLIP_BYTES_PER_ELEMENT = 12
OPTIMIZER_BYTES_PER_ELEMENT = ADAMW_BYTES_PER_ELEMENT + CLIP_BYTES_PER_ELEMENT
# aten operators one forward runs, counted with a TorchDispatchMode on the tiny presets (fp32, CPU): per dense
# block, per MoE block (the fused expert op is one call whatever the expert count), and embedding + final norm +
# loss head; a backward runs about twice as many
DENSE_BLOCK_OPS, MOE_BLOCK_OPS, ROOT_OPS = 84, 92, 23
BACKWARD_OPS_FACTOR = 2.0
# the share of a block's operators whose launch the host still pays under train.compile (parallelize.py compiles
# each block; the embedding, head and loss stay eager): Mula-1B on an H200 left the GPU idle 0.312 s a step eager
# and 0.029 s compiled (benchmarks/step_profile.py, 2026-11-26)
COMPILED_OPERATOR_SHARE = 0.1
# the vocab-parallel loss (parallel/vocab_parallel.py) reduces its logits across tp with separate passes (amax, sub_,
# exp_, sum, mul_: 8 read or write streams of fp32 where the fused loss head's softmax makes 3): 20 bytes a logit
# beyond what the loss_head class, timed on the fused op, includes (60-67 ms a step of dense TP 2 on the 2-core EPYC)
VOCAB_PARALLEL_EXTRA_BYTES = 20
OPTIMIZER_OPS = 60  # the fused AdamW update and the foreach gradient clipping: a few dozen operators per step
# where a rank's weights stay fp32 while its blocks compute in bf16 (weight_pass_bytes), autocast reads each matrix
# (4 B) and writes its bf16 copy (2 B) in every forward, and the backward's bf16 weight gradient is read (2 B) and
# written back in fp32 (4 B); accumulating a gradient over micro-batches (grad += new) reads two and writes one
AUTOCAST_CAST_BYTES = 6
ACCUMULATE_PASSES = 3


@dataclass
class StepTime:
    """One step's predicted time and its parts (seconds), and what it yields."""

    step_s: float
    parts: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    bubble_fraction: float = 0.0


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
    else:  # none; selective_ops recomputes no matmul, attention or expert GEMM (their outputs are kept)
        chosen = ()
    return {c: by_class[c] / 3.0 for c in chosen}


def replays_forward_ops(config: Config) -> bool:
    """Whether the recompute runs every forward operator again but the kept ones (selective_ops: torch's op-level
    checkpointing replays the block and takes only the matmuls', attention's, the expert GEMMs' and the non-gather
    collectives' outputs from its cache, parallelize.py): autocast's weight casts and the all-gathers run again,
    which a recomputed sub-module does only for its own."""
    return config.train.activation_checkpointing == "selective_ops"


def memory_bound_bytes(config: Config, dims: ParallelDims, layers: int, recompute: bool,
                       fused_only: bool = False) -> float:
    """HBM bytes one micro-batch's memory-bound ops move on one rank (forward, backward = 2x, a recomputed forward).

    Per token and block, in activation elements (h = d_model, kv = KV width, f = FFN width, k = top_k, fe = expert
    width, E = experts): two norms read and write h (4h), QK-norm and RoPE read and write q and k (4 (h + kv)), two
    residual adds read two and write one (6h), SwiGLU reads gate and up and writes their product (3f, or k x 3fe
    for MoE plus the router's E logits read and written twice (4E) and the permute/unpermute of k rows (4kh)).
    Split over tp (sequence parallel). fused_only: just the bytes of the expert path's own fused kernels (its
    SwiGLU, permute and unpermute: ops/), which move this count eager or compiled; the rest are torch operators
    that eager mode runs one kernel each (Efficiency.eager_memory_traffic).
    """
    m, train = config.model, config.train
    width = 2 if train.dtype == "bf16" else 4
    h, kv = m.d_model, m.kv_heads * m.head_dim
    fused = (3 * m.top_k * m.expert_ffn_hidden + 4 * m.top_k * h) if m.is_moe else 0
    operators = 4 * h + 4 * (h + kv) + 6 * h + (4 * m.n_experts if m.is_moe else 3 * m.ffn_hidden)
    per_token_layer = fused if fused_only else fused + operators
    passes = 3 + (1 if recompute else 0)  # forward, backward (reads saved + writes gradients), recompute
    tokens = train.micro_batch_size * train.seq_len
    return tokens * layers * per_token_layer * width * passes / dims.tp


def weight_pass_bytes(config: Config, dims: ParallelDims, shape: ModelShape, layers: int, head: bool,
                      recomputed: dict[str, float], micro_batches: int) -> float:
    """HBM bytes one micro-batch moves over a stage's weights and gradients outside the matmuls. Where a rank keeps
    whole gradients over the micro-batches (one process, tp or pp alone, ddp, zero1; FSDP where it defers its
    reduce-scatter: under pp, as torch's schedules do, or defer_grad_sync=all, accumulating in the reduce dtype),
    every micro-batch after the first adds its gradients to those held (ACCUMULATE_PASSES of the parameters' width).
    Where FSDP (not deferring) reduces to a shard every micro-batch, each later micro-batch instead sums its reduced
    shard into the fp32 shard gradients (FSDP2's sharded .grad): the same passes over the elements the rank owns.
    zero2 (any parallel layout: optim/sharded.py packs and frees each gradient in every backward, on one rank too)
    sums into its grad_shard among its buffer copies (data_parallel_time._zero_copy_bytes), so nothing here: pricing
    it twice put moe-tp2-zero2-selective-mb2 0.04 s (2%) high.

    Where the weights stay fp32 under bf16 compute (as activation_memory.autocast_weight_copy_bytes: no data
    parallelism, or ddp; FSDP gathers bf16 weights and the zero modes keep bf16 parameters), autocast casts every
    matrix in the forward, again where recomputed, and its gradient back to fp32 in the backward
    (AUTOCAST_CAST_BYTES each).
    Measured: the compiled Mula-7B-A1B block on one H100 spent 48 ms of a 0.28 s step in these casts and the fp32
    adds (triton to_copy kernels and CUDAFunctor_add over 1.9 B parameters, benchmarks/step_profile.py), which the
    compiled step's fused count left out (15% too fast).
    """
    p, bf16 = config.parallel, config.train.dtype != "fp32"
    fp32_weights = weights_stay_fp32(config, dims)  # under bf16 compute: autocast casts them
    zero2_sums_shards = p.shard_mode == "zero2" and dims.is_parallel
    owned_over = (1, 1)  # what the (dense, expert) gradients summed are split over: whole, unless reduced to shards
    if fp32_weights:
        gradient_width = 4
    elif p.shard_mode == "zero1":  # its parameters in the compute dtype, their gradients summed in place
        gradient_width = 2 if bf16 else 4
    elif p.shard_mode == "fsdp" and (dims.pp > 1 or p.defer_grad_sync == "all"):
        gradient_width = p.grad_reduce_bytes  # FSDP2 accumulates unsharded gradients in its reduce dtype
    elif p.shard_mode == "fsdp" and dims.has_data_parallel:
        gradient_width = 4  # fp32 shards (FSDP2 casts a bf16-reduced shard up before summing it), owned over
        owned_over = (dims.dp_shard, dims.dp_shard_mod_ep)  # dp_shard (its experts' over dp_shard / ep)
    else:
        return 0.0
    t = dims.tp
    attention = layers * shape.block_attention / t
    mlp = layers * (shape.block_tp_split - shape.block_attention) / t
    experts = layers * shape.block_experts / (dims.ep * t)
    root = (shape.head + (shape.embedding if dims.pp == 1 else 0)) / t if head else shape.embedding / t
    parameters = (attention + mlp + layers * shape.block_replicated + root) / owned_over[0] + experts / owned_over[1]
    accumulate = 0.0 if zero2_sums_shards else \
        ACCUMULATE_PASSES * gradient_width * parameters * (micro_batches - 1) / micro_batches
    if not (bf16 and fp32_weights):
        return accumulate
    matrices = attention + mlp + experts + (shape.head / t if head else 0.0)
    if replays_forward_ops(config):  # every cast replayed
        again = attention + mlp + experts
    else:
        again = ((attention if recomputed.get("attention_proj") else 0.0) + (mlp if recomputed.get("mlp") else 0.0) +
                 (experts if recomputed.get("experts") else 0.0))
    return accumulate + AUTOCAST_CAST_BYTES * (2 * matrices + again)


def operators_per_micro_batch(config: Config, layers: int, recompute: bool, root: bool) -> float:
    """Operators one rank launches for one micro-batch (forward, backward, recomputed forward); a compiled block's
    fused kernels count as COMPILED_OPERATOR_SHARE of its eager operators."""
    block = (MOE_BLOCK_OPS if config.model.is_moe else DENSE_BLOCK_OPS) * \
        (COMPILED_OPERATOR_SHARE if config.train.compile else 1.0)
    forward = layers * block + (ROOT_OPS if root else 0)
    return forward * (1 + BACKWARD_OPS_FACTOR + (1 if recompute else 0))


def busiest_expert_pace(imbalance: float, group: int, core_share: float) -> float:
    """How much longer than at balanced routing the busiest of a `group` of ranks splitting the experts (ep x tp)
    takes over its expert GEMMs, holding `imbalance` times its balanced rows while the others split the rest
    evenly. On cores of its own, that factor. Where ranks outnumber cores (`here`: core_share = cores / ranks < 1)
    the cores are shared as the kernel does (processor sharing, every group alike): all ranks run at core_share
    until the lighter ones finish and wait in the exchange, then the busiest ranks, one a group, split the cores
    among themselves (at most one each). At ep 2 on 4 ranks and 2 cores they get a core each and catch up exactly:
    no cost; at ep x tp 4 the one busiest rank can use one core of two, and 1.2x its rows cost 6.7% more."""
    if group <= 1 or imbalance <= 1.0:
        return 1.0
    if core_share >= 1.0:
        return imbalance
    lighter = max(0.0, (group - imbalance) / (group - 1))  # each other member's rows over its balanced share
    alone = min(1.0, core_share * group)  # the busiest ranks' rate once the others wait (one rank in `group` runs)
    return max(1.0, lighter + (imbalance - lighter) * core_share / alone)


# a step's waits on collectives
COLLECTIVE_PARTS = ("tp", "ep", "pp_p2p", "fsdp_exposed", "zero2_exposed", "dp_sync", "step_collectives")


def step_time(config: Config, dims: ParallelDims, shape: ModelShape, cluster: Cluster,
              efficiency: Efficiency | None = None, micro_batches: int = 1, routing_imbalance: float = 1.0) -> StepTime:
    """Predict one optimizer step of `config` (validated, micro-batch resolved) laid out as `dims`.

    efficiency: per op class; None takes the cluster's (its preset's defaults, or the calibration here).
    routing_imbalance: the busiest rank's routed rows over its balanced share where ep or tp split the experts; the
    step waits for that rank's expert GEMMs (its exchanges are priced at the balanced volume), beyond what shared
    cores absorb where ranks outnumber them.

    Where the cluster timed what a collective reached after compute costs beyond its back-to-back call (`here`:
    Cluster.collective_sync), every timed call pays that too, at the layout's compute between two collectives.
    """
    args = (config, dims, shape, cluster, efficiency, micro_batches, routing_imbalance)
    if not cluster.collective_sync:
        return _priced_step(*args)
    # Where a collective reached after compute costs more than the table's back-to-back call (`here`), by how long
    # the ranks computed before it: priced without that first, the step's collectives counted (what one more
    # microsecond a call adds to the step: those on its critical path) and its compute between two of them read
    # off, then priced at what a call costs after that much compute
    plain = _priced_step(*args[:3], replace(cluster, collective_sync_s=0.0), *args[4:])
    nudged = _priced_step(*args[:3], replace(cluster, collective_sync_s=SYNC_NUDGE_S), *args[4:])
    collectives = (nudged.step_s - plain.step_s) / SYNC_NUDGE_S
    if collectives < 0.5:
        return plain
    computing = plain.step_s - sum(plain.parts.get(part, 0.0) for part in COLLECTIVE_PARTS)
    sync = sync_after_compute(cluster.collective_sync, computing / collectives)
    # tensor parallelism's calls are priced each at the compute before it instead (block_collectives)
    return _priced_step(*args[:3], replace(cluster, collective_sync_s=sync), *args[4:], tp_gaps=True)


SYNC_NUDGE_S = 1e-6  # added to every timed call, what it adds to the step counts the collectives on its path


def _priced_step(config: Config, dims: ParallelDims, shape: ModelShape, cluster: Cluster,
                 efficiency: Efficiency | None, micro_batches: int, routing_imbalance: float,
                 tp_gaps: bool = False) -> StepTime:
    """step_time with the cluster's collective_sync_s as given; with tp_gaps, tensor parallelism's calls pay the
    cluster's collective_sync at the compute before each (TensorParallelGaps) instead, and the step's small
    collectives once, after the optimizer's update (step_collectives_time)."""
    efficiency = efficiency or cluster.efficiency
    config = cluster.resolved(config)  # "auto" priced as the dtype the trainer runs on these devices
    train, p = config.train, config.parallel
    dtype = "fp32" if train.dtype == "fp32" else "bf16"
    width = 2 if dtype == "bf16" else 4
    peak = cluster.peak_flops(dtype)
    h = config.model.d_model
    tokens_mb = train.micro_batch_size * train.seq_len
    m = config.model
    if efficiency.by_rows:  # a calibration's rates by the rows a call runs: this layout's (micro-batch, ep)
        efficiency = efficiency.at_rows(call_rows(tokens_mb, m.top_k, m.n_experts if m.is_moe else 0, dims.ep))
    by_class = _flops_by_class(config, shape)
    recomputed = _recomputed_flops(config, by_class)
    rate = {"attention_proj": efficiency.dense_gemm, "mlp": efficiency.dense_gemm, "head": efficiency.loss_head,
            "experts": efficiency.grouped_gemm, "attention": efficiency.attention}
    layers = -(-shape.n_layers // dims.pp)
    # the pipeline runs at the pace of its slowest stage: the last one, which holds ceil(L / pp) blocks AND the
    # whole LM head and loss (the first holds the embedding, a lookup); with few blocks per stage the head is a
    # large share of it (220B-A10B at pp 32: 2 blocks + a head worth ~1.5 blocks)
    share = {c: (1.0 if c == "head" else layers / shape.n_layers) for c in by_class}

    def class_seconds(flops: dict[str, float]) -> dict[str, float]:
        """A micro-batch's seconds on this stage's ranks for FLOPs per token by class, at each class's rate."""
        return {c: tokens_mb * flops[c] * share[c] / dims.tp / (peak * rate[c]) for c in flops}

    flop_s = class_seconds({c: by_class[c] + recomputed.get(c, 0.0) for c in by_class})
    # roofline: a GEMM cannot run faster than its weights stream from HBM, read in the forward, read for the
    # input gradient and written as the weight gradient (3 passes), once more when recomputed; this is what
    # makes experts that see few tokens each (small ep, small micro-batches) memory bound
    hbm = cluster.hbm_gb_s * 1e9
    # the last pipeline stage paces the pipe: its blocks plus the whole LM head (split over tp: vocab-parallel)
    block_weights = layers * (shape.block_tp_split / dims.tp + shape.block_replicated)
    dense_weights = block_weights + shape.head / dims.tp
    expert_weights = layers * shape.block_experts / (dims.ep * dims.tp)  # tp ranks split the experts too
    dense_passes = 3 + (1 if recomputed.get("attention_proj") or recomputed.get("mlp") else 0)
    expert_passes = 3 + (1 if recomputed.get("experts") else 0)
    busiest = busiest_expert_pace(routing_imbalance, dims.ep * dims.tp, cluster.core_share)
    expert_s = max(busiest * flop_s["experts"], expert_passes * width * expert_weights / hbm) if expert_weights else 0.0
    recompute = config.train.activation_checkpointing != "none"
    # the rank's cores bound its elementwise work and its optimizer update, not the socket (`here`)
    core_bandwidth = cluster.core_bandwidth_gb_s * 1e9 or hbm
    hbm_eff = core_bandwidth * efficiency.memory_bound
    # eager operators move more than the fused count (each its own kernel, fp32 upcasts written out); compiled
    # blocks fuse them; the expert path's own kernels are fused either way
    traffic = 1.0 if config.train.compile else efficiency.eager_memory_traffic
    fused_bytes = memory_bound_bytes(config, dims, layers, recompute, fused_only=True)
    operator_bytes = memory_bound_bytes(config, dims, layers, recompute) - fused_bytes
    blocks_memory_mb = (traffic * operator_bytes + fused_bytes) / hbm_eff

    def stage_mb(head: bool) -> tuple[float, float, float, float, float]:
        """A stage's seconds per micro-batch as (matmuls and attention, memory-bound work, operator launches,
        DTensor dispatch, passes over its weights at the optimizer class's rate: weight_pass_bytes): the last stage
        with the LM head, or another with its blocks only (the embedding is a lookup), which pays its blocks'
        per-operator costs in full. (Scaling the last stage by the FLOPs left without the head dropped them with the
        head's FLOPs: under tp on CPU, 87% of the tiny dense model's first-stage DTensor dispatch; that stage read
        0.25 core-s a step where its ranks used 0.44, now 0.34.)"""
        matmuls = max(flop_s["attention_proj"] + flop_s["mlp"] + (flop_s["head"] if head else 0.0),
                      dense_passes * width * (dense_weights if head else block_weights) / hbm)
        memory = blocks_memory_mb
        if head and dims.tp > 1:  # the vocab-parallel loss's own passes over its fp32 logits (the loss_head
            # class is the fused loss)
            memory += VOCAB_PARALLEL_EXTRA_BYTES * tokens_mb * config.model.vocab_size / dims.tp / hbm_eff
        operators = efficiency.op_overhead_us * 1e-6 * operators_per_micro_batch(config, layers, recompute, root=head)
        dispatch = (efficiency.dtensor_overhead_us * 1e-6 * dtensor_operators(config, layers, recompute, root=head)
                    if dims.tp > 1 else 0.0)
        passes = weight_pass_bytes(config, dims, shape, layers, head, recomputed, micro_batches) / \
            (hbm * efficiency.optimizer)
        return matmuls + expert_s + flop_s["attention"], memory, operators, dispatch, passes

    last_stage = stage_mb(head=True)
    _, memory_mb, overhead_mb, dispatch_mb, passes_mb = last_stage
    compute_mb = sum(last_stage)
    # the other stages' cost sets the pipe's fill and drain and their use of shared cores; without a pipeline
    # there is none (and the search prices thousands of layouts)
    headless_mb = sum(stage_mb(head=False)) if dims.pp > 1 else compute_mb

    act_bytes = tokens_mb * h * width
    again = replayed_collectives(config)
    tp_mb = 0.0
    if dims.tp > 1:
        gaps = None
        if tp_gaps:
            # one micro-batch's forward on the last stage, split where tp's collectives fall: the GEMMs at their
            # classes' rates (the forward a third of the training FLOPs), the rest (memory-bound work, operator
            # launches, DTensor dispatch) a forward pass's share of the micro-batch's
            forward = class_seconds({c: flops / 3 for c, flops in by_class.items()})
            kv = config.model.kv_heads * config.model.head_dim
            qkv_share = (h + 2 * kv) / (2 * h + 2 * kv)  # of the attention projections' FLOPs
            passes = 3 + (1 if recompute else 0)
            gaps = TensorParallelGaps(
                qkv=qkv_share * forward["attention_proj"] / layers,
                attention=((1 - qkv_share) * forward["attention_proj"] + forward["attention"]) / layers,
                # under ep the closing reduce-scatter follows the combine, not the experts
                mlp=0.0 if config.model.is_moe and dims.ep > 1 else
                (forward["mlp"] + expert_s / expert_passes) / layers,
                between=(memory_mb + overhead_mb + dispatch_mb) / passes / layers, head=forward["head"])
        tp_mb = tensor_parallel_time(config, dims, cluster, layers, act_bytes, again, gaps)
    ep_mb = expert_parallel_time(config, dims, cluster, layers, tokens_mb, act_bytes, again) if dims.ep > 1 else 0.0
    pp_mb = pp_fill = 0.0
    if dims.pp > 1:
        # activations forward and their gradients backward, one of each per micro-batch and virtual stage; the
        # schedule posts them asynchronously (isend/irecv), so in the steady state they hide behind the next
        # micro-batch's compute and only the excess shows; filling and draining the pipe waits for each hop
        virtual_sends = 2 * (p.pp_virtual_stages if dims.pp > 1 else 1)
        one_send = send_time(group_link(dims, ("pp",), cluster), act_bytes / dims.tp)
        pp_mb = max(0.0, virtual_sends * one_send - (compute_mb if cluster.comm_overlaps_compute else 0.0))
        pp_fill = 2 * (dims.pp - 1) * one_send

    # what compute hides of a collective: the micro-batch's compute (the backward's 2/3 for gradient traffic)
    # where the links move bytes beside it, nothing where the ranks' own cores must move them (`here`)
    overlap = compute_mb if cluster.comm_overlaps_compute else 0.0
    dp = data_parallel_time(config, dims, shape, cluster, layers, micro_batches, 2 / 3 * overlap,
                            hbm * efficiency.buffer_copy, hbm * efficiency.optimizer)
    # the clipping and the update over the parameters this rank owns, at the optimizer class's own rate (a fused
    # in-place kernel, not the unfused elementwise ops memory_bound times), on the bandwidth its cores have
    optimizer = (dp.owned * OPTIMIZER_BYTES_PER_ELEMENT / (core_bandwidth * efficiency.optimizer) +
                 efficiency.op_overhead_us * 1e-6 * OPTIMIZER_OPS)

    exposed_fsdp = max(0.0, dp.overlappable_mb - overlap)
    # what the last micro-batch's backward adds: FSDP's deferred reduce-scatter, HSDP's all-reduces
    exposed_once = max(0.0, dp.overlappable_mb + dp.last_backward - overlap) - exposed_fsdp
    per_mb = compute_mb + tp_mb + ep_mb + pp_mb + exposed_fsdp + dp.exposed_mb + dp.copies_mb
    virtual = p.pp_virtual_stages if dims.pp > 1 else 1
    busy = per_mb * micro_batches
    # The last stage (it holds the LM head) paces the pipe: it runs its m micro-batches back to back once the first
    # has come through the other stages, and the step ends when the last backward has gone back through them, so the
    # fill and drain cost (pp - 1) / v micro-batch times of a stage WITHOUT the head (torch's 1F1B and GPipe: the
    # textbook (pp - 1) / (m + pp - 1) bubble when stages are equal). The other stages compute headless_mb per
    # micro-batch. A rank idle in the fill/drain waits; where ranks outnumber cores (`here`,
    # core_share < 1) its core runs the other ranks meanwhile (work-conserving): the step is then the larger of
    # that critical path at the cores' share and the stages' average busy time (all ranks' core-seconds over cores).
    other_stage = busy - (compute_mb - headless_mb) * micro_batches
    fill_drain = (dims.pp - 1) / virtual * other_stage / micro_batches if dims.pp > 1 else 0.0
    average_busy = (busy + (dims.pp - 1) * other_stage) / dims.pp
    pipeline = max(average_busy, (busy + fill_drain) * cluster.core_share) + pp_fill
    bubble = fill_drain / (busy + fill_drain) if busy + fill_drain > 0 else 0.0
    # the loss, the norm, the callbacks' figures; the first after the update pays the sync where tp's calls do
    small = step_collectives_time(config, dims, cluster, layers, optimizer if tp_gaps else None)
    step = pipeline + exposed_once + dp.step_sync + dp.copies_step + optimizer + small
    tokens = train.global_batch_size * train.seq_len
    active = shape.total - (shape.n_layers * (shape.block_experts - shape.block_experts * config.model.top_k
                                               // config.model.n_experts) if config.model.is_moe else 0)
    model_flops = flops_per_token(ParameterCount(shape.total, active, shape.embedding), config.model, train.seq_len)
    mfu = model_flops * tokens / (step * dims.world_size * peak)
    parts = {"compute": (compute_mb - memory_mb - overhead_mb - dispatch_mb - passes_mb) * micro_batches,
             "memory_bound": memory_mb * micro_batches, "weight_passes": passes_mb * micro_batches,
             "op_overhead": overhead_mb * micro_batches,
             "tp_dispatch": dispatch_mb * micro_batches, "tp": tp_mb * micro_batches, "ep": ep_mb * micro_batches,
             "pp_p2p": pp_mb * micro_batches, "fsdp_exposed": exposed_fsdp * micro_batches + exposed_once,
             "zero2_exposed": dp.exposed_mb * micro_batches,
             "buffer_copies": dp.copies_mb * micro_batches + dp.copies_step,
             "bubble": pipeline - busy, "dp_sync": dp.step_sync, "optimizer": optimizer, "step_collectives": small}
    return StepTime(step, parts, tokens / step, mfu, bubble)
