"""Activation memory by formula: what each micro-batch keeps for its backward under every checkpointing mode,
what a rank needs once (the block being recomputed, the loss head's buffers), the residual stream's width, and the
micro-batches a pipeline schedule keeps in flight.

The dry run (dry_run.py) adds these to the parameters it measures on the meta device; the planner
(optimus/plan/memory.py) adds them to its arithmetic of the same parameters for every layout it ranks. Each formula
is in its function's docstring, with what it was checked against (BENCHMARKS.md, "Planner vs measured here").
"""

from __future__ import annotations

from optimus.config import Config
from optimus.ops.cross_entropy import DEFAULT_CHUNK_ROWS, GRAD_W_SLICE_ROWS
from optimus.parallel.mesh import ParallelDims
from optimus.parallel.validate import BatchLayout, resolve_batch


def activation_bytes(config: Config, dims: ParallelDims, layers: int, has_loss_head: bool,
                     loss_on_cpu: bool = False, routing_imbalance: float = 1.0) -> float:
    """Activation bytes one rank keeps for one micro-batch alone: activation_split's two parts."""
    return sum(activation_split(config, dims, layers, has_loss_head, loss_on_cpu, routing_imbalance))


def rank_activation_bytes(config: Config, dims: ParallelDims, layers: int, has_loss_head: bool, in_flight: float,
                          loss_on_cpu: bool = False, routing_imbalance: float = 1.0) -> float:
    """Activation bytes of a rank holding `in_flight` micro-batches: each keeps its saved tensors, but only one is
    in its backward at a time, so the recompute working set and the loss head's buffers exist once."""
    kept, once = activation_split(config, dims, layers, has_loss_head, loss_on_cpu, routing_imbalance)
    head = head_kept_bytes(config, dims, loss_on_cpu) if has_loss_head else 0.0
    # the LM head runs in the last (virtual) stage only: one micro-batch at a time there, as forward and backward
    # alternate, except under GPipe, whose forwards all run before the first backward
    head_in_flight = in_flight if forwards_first(config, dims) else 1
    return in_flight * (kept - head) + head_in_flight * head + once


def head_kept_bytes(config: Config, dims: ParallelDims, loss_on_cpu: bool = False) -> float:
    """Bytes the LM head's stage keeps per micro-batch for its loss (part of activation_split's kept): the head's
    input (w h per token: saved, or the fused loss's input gradient) and loss_head_bytes' kept part."""
    w = 2 if config.train.dtype == "bf16" else 4
    tokens = step_batch(config, dims).micro_batch_size * config.train.seq_len
    h = config.model.d_model
    # the final norm keeps its fp32 input (the stream, or its fp32 copy) and its normed value in the stream's width
    final_norm = (4 + stream_width(config, dims)) * h if dims.tp == 1 else 0.0
    return tokens * (h * w + final_norm) + loss_head_bytes(config, dims, tokens, loss_on_cpu)[0]


def loss_head_bytes(config: Config, dims: ParallelDims, tokens: int, loss_on_cpu: bool) -> tuple[float, float]:
    """(bytes kept per micro-batch, bytes held once) of the loss on the LM head's output, beyond the head's input,
    as the trainer computes it on that device (w = compute width, V vocabulary, h d_model, t = tp, n tokens):
      tp > 1, any device (parallel/vocab_parallel.py, chunks of r = min(512, n) rows): the fp32 [r, V/t] softmax
        (4; fp32 logits are computed into it) and, under bf16, the bf16 logits and the softmax's bf16 copy (2 + 2),
        and one bf16 partial product of the weight gradient (2 V h / t), held once; the fp32 gradient of the rank's
        head rows (4 V h / t), formed in the forward and kept until the backward scales it.
      CPU (ops/cross_entropy.py's chunked op): one [r, V] buffer (w) and, under bf16, the weight gradient's bf16
        and fp32 partial products, a slice of s = min(GRAD_W_SLICE_ROWS, V) vocabulary rows each ((2 + 4) s h),
        held once; the fp32 weight gradient (4 V h), kept as above.
      accelerators (the plain F.cross_entropy over fp32 logits): the fp32 log-softmax is kept (4 n V) and its
        backward holds two more fp32 [n, V] gradients at once (8 n V); measured with MemTracker on CPU tensors.
    """
    m, t = config.model, dims.tp
    vocab, h = m.vocab_size, m.d_model
    w = 2 if config.train.dtype == "bf16" else 4
    rows = min(DEFAULT_CHUNK_ROWS, tokens)
    if t > 1:
        return 4.0 * vocab * h / t, rows * vocab / t * (4 + (4 if w == 2 else 0)) + (2 if w == 2 else 0) * vocab * h / t
    if loss_on_cpu:
        held = rows * vocab * w + (6 if w == 2 else 0) * min(GRAD_W_SLICE_ROWS, vocab) * h
        stream = stream_width(config, dims)
        # at the op's forward (the step's peak on a CPU): its input, the final norm's output in the stream's width,
        # with its bf16 cast where the stream is fp32 and the compute bf16, and then the head weight's bf16 cast too
        held += tokens * h * (stream + (w if stream != w else 0)) + (2.0 * vocab * h if stream != w else 0.0)
        return 4.0 * vocab * h, held
    return 4.0 * tokens * vocab, 8.0 * tokens * vocab


def activation_split(config: Config, dims: ParallelDims, layers: int, has_loss_head: bool,
                     loss_on_cpu: bool = False, routing_imbalance: float = 1.0) -> tuple[float, float]:
    """(bytes each micro-batch in flight keeps, bytes a rank needs once whatever its micro-batches in flight:
    the block being recomputed, the loss head's buffers) (estimate; formula below).

    routing_imbalance: the token copies the busiest rank's experts receive, as a multiple of its balanced share
    (n k per token over the ranks that split the experts), where ep or tp split them; 1 is balanced routing. Every
    term below that follows a rank's expert rows is scaled by it (a dropless MoE keeps what its routing sends).

    Bytes saved for backward per token and layer, with w = activation width (2 for bf16, 4 for
    fp32), h = d_model, kv = KV width, f = ffn width, k = top_k, fe = expert width, E = experts,
    t = tp, and g = w h when t > 1 (the all-gathered block input that tensor-parallel matmuls keep),
    else 0. An RMSNorm of width n keeps its fp32 input and its output: norm(n) = (4 + w) n.
    At t = 1 the block's two norms of the residual stream are stream_norm(readers) (the stream is fp32 where the
    weights stay fp32, even under bf16 autocast: stream_width), the attention output is kept once with its fp32
    logsumexp (w h + 4 H), the MoE router keeps 8E + 4 + 8k and the fused expert op its int64 order (8k), plus
    rotary cos/sin per micro-batch and, on the head's stage, the final norm (BENCHMARKS.md, stop 29: within 0.2% of
    the allocator's peak at seq 1k-16k, one process; within 5% of autograd's saved tensors). At t > 1:
        attention   norm(h)/t + g + [norm(h) + norm(kv) (QK-norm) + w (h + 2kv) (q, k, v after
                    RoPE) + 2 w h (attention output, and its copy as o_proj input)] / t
        dense MLP   norm(h)/t + g + 4 w f / t (gate, silu(gate), up, their product)
        MoE MLP     norm(h)/t + g + (4 + w) E (router logits and fp32 probabilities) + the experts:
                    w k (2fe + 1) (the fused op keeps only the gate/up output and the row weights;
                    it re-gathers rows and recomputes SwiGLU in backward), or with ep > 1, where
                    rows travel between ranks, w k (2h + 2fe) (the rank's rows in, gate/up, and the
                    rows out for the combine) + 8 k x 4 int64 row orders (all_to_all), times
                    routing_imbalance (the tiny MoE's random router at init gave one rank 1.06-1.26x
                    its balanced rows over its layers, up to 1.66x in one); with
                    t > 1 the tp ranks split the experts and gather and combine only their own rows:
                    w k (2h + 2fe) / t (the rank's rows in, or dispatched, gate/up, and the rows out
                    its combine keeps), plus ep's row orders; allgather adds 12 k ep (the int64 sort
                    of the ep group's gathered copies and their fp32 router weights, whatever the routing)
    Full checkpointing keeps each block's input (w h / t; at t = 1 in the stream's width) plus one block recomputed
    at a time (on the head's rank the larger of it and the loss's buffers: the one runs after the other is freed).
    A block's backward holds gradients on top, in every mode: a dense MLP its gate and up outputs'
    (_dense_mlp_backward), a tensor-parallel MoE block its combine's (_tp_moe_backward); selective_ops what it
    replays (_tp_moe_replay).
    Selective (the train.recompute mask): a recomputed sub-module keeps only its input, the others
    their full terms above: "norms" turns each norm(h)/t into w h / t (and QK-norm into w (h + kv) / t
    unless attention is recomputed), "attention" turns the attention terms after its norm into w h,
    "moe" / "mlp" the feed-forward terms after its norm into w h; plus one recomputed sub-module's
    full activations at a time. Ops (op-level policy) keeps the outputs of matmuls, attention and the
    fused expert op, and the collectives' but the all-gathers', and recomputes norms and activations:
        attention w (2h + 2kv) / t + w h (q, k, v, attention; the output projection's partial sums, whole),
        dense w (2f / t + h), MoE w E (router logits) + w h + 2 w k fe + 8k (the fused op: combined output,
        gate/up rows, their int64 order), or where ep or tp split the experts w k (h + 2fe + x h) / t (the rank's
        rows out and gate/up, x = 2 all_to_all exchanges kept) or under allgather w k (h + 2fe) / t + w h (its
        reduce-scattered tokens); each + w h / t (its
        reduce-scatter) when t > 1. Checked against the bytes the policy keeps (tests/distributed/
        test_checkpointing_collectives.py): within 10% on average over the ranks.
    Plus the embedding output (w h / t; at t = 1 the first norm keeps it, unless a checkpoint or a pipeline stage
    keeps it as the block input) and, on the rank with the LM head, its input (w h per token: saved, or the CPU loss
    op's input gradient) and the loss's buffers (loss_head_bytes: they depend on the device). Checked against the
    tensors autograd really saves (tiny fp32 and bf16 models on CPU, no checkpointing): within 5%.
    """
    m, t = config.model, dims.tp
    h, kv = m.d_model, m.kv_heads * m.head_dim
    tokens = step_batch(config, dims).micro_batch_size * config.train.seq_len
    w = 2 if config.train.dtype == "bf16" else 4

    def norm(n: int) -> float:
        return (4 + w) * n

    stream = stream_width(config, dims)

    def stream_norm(readers: int) -> float:
        """A norm of the residual stream with the sub-layer that reads it (t = 1): pre-norm keeps its fp32 input
        (the stream, or its fp32 copy) and its normed value in the stream's width; the sub-layer's `readers`
        linears keep their input, one shared tensor, or each its own bf16 cast of an fp32 stream. Post-norm reads
        the stream itself and norms the sub-layer's (w-wide) output. Measured tensor by tensor on CPU (fp32, bf16
        weights, fp32 weights under bf16 autocast; pre- and post-norm) and by the allocator's peak on CPU and one
        H100 (eager): within 0.2% where activations set the peak."""
        if config.train.compile:  # fused: the norm's input, and its output as its readers' shared input
            return norm(h)
        read = readers * w * h if stream != w else stream * h
        return (norm(h) if m.norm_placement == "post" else (4 + stream) * h) + read

    gathered = w * h if t > 1 else 0
    # selective_ops: the outputs of the policy's ops (parallelize._kept_ops); a sequence-parallel reduce-scatter's
    # output is w h / t, the row-parallel projection's before it whole (partial sums)
    scattered = w * h / t if t > 1 else 0
    if t == 1:  # the attention output is kept once (o_proj reads it as a view), with its fp32 logsumexp per head
        attn_full = stream_norm(3) + norm(h) + norm(kv) + w * (h + 2 * kv) + w * h + 4 * m.n_heads
    else:
        attn_full = norm(h) / t + gathered + (norm(h) + norm(kv) + w * (h + 2 * kv) + 2 * w * h) / t
    attn_selective = w * (2 * h + 2 * kv) / t + w * h + scattered
    if m.is_moe:
        k, fe = m.top_k, m.expert_ffn_hidden
        # the busiest rank's share of the routed rows, where ranks split the experts (each computes its own)
        busiest = routing_imbalance if dims.ep > 1 or t > 1 else 1.0
        allgather = dims.ep > 1 and config.parallel.ep_dispatch == "allgather"
        # all_to_all: the exchange's int64 row orders (the dispatch's sort and its inverse, the received rows'
        # grouping by expert and its inverse), per routed row; allgather: the sort of every gathered copy (int64)
        # and the gathered router weights (fp32) the combine keeps, over the ep group's tokens
        ep_orders = 8 * k * 4 if dims.ep > 1 and not allgather else 0
        gathered_routing = 12 * k * dims.ep if allgather else 0
        if t == 1:  # the fused op (its row order in int64), or the rows ep exchanges; the router: fp32
            # probabilities, the z-loss's fp32 logits and logsumexp, topk's int64 ids
            experts = (w * k * (2 * fe + 1) + 8 * k if dims.ep == 1
                       else busiest * (w * k * (2 * h + 2 * fe) + ep_orders) + gathered_routing)
            mlp_full = stream_norm(2) + experts + 8 * m.n_experts + 4 + 8 * k
        else:  # expert_tensor_parallel: this rank's rows in (dispatched under ep), gate/up, and out (combined)
            experts = busiest * (w * k * (2 * h + 2 * fe) + ep_orders) / t + gathered_routing
            mlp_full = norm(h) / t + gathered + experts + (4 + w) * m.n_experts
        if dims.ep == 1 and t == 1:  # the fused op: its combined output, the gate/up rows, the rows' order (int64)
            experts_kept = w * h + 2 * w * k * fe + 8 * k
        else:  # the rank's rows (expert_mlp): their output and gate/up; and the ep exchanges' outputs, the
            # dispatched and returned rows (all_to_all) or the reduce-scattered combined tokens (allgather)
            exchanges = 2 if dims.ep > 1 and not allgather else 0
            experts_kept = busiest * w * k * (h + 2 * fe + exchanges * h) / t + (w * h if allgather else 0)
        mlp_selective = experts_kept + w * m.n_experts + scattered
    else:
        mlp_full = (stream_norm(2) if t == 1 else norm(h) / t + gathered) + 4 * w * m.ffn_hidden / t
        mlp_selective = w * (2 * m.ffn_hidden / t + h) + scattered
    mode = config.train.activation_checkpointing
    # a block's input as a checkpoint or a pipeline stage keeps it; without either, the first norm keeps the
    # embedding's output (counted in stream_norm)
    block_input = w * h / t if t > 1 else stream * h
    first_input = 0.0 if t == 1 and mode == "none" and dims.pp == 1 else block_input
    working = 0.0  # per token: the block (or sub-module) being recomputed, one at a time on the rank
    if mode == "full":
        per_token, working = layers * block_input, attn_full + mlp_full
    elif mode == "selective":
        kept, working = _selective_layer(config, dims, attn_full, mlp_full)
        per_token = layers * kept
    elif mode == "selective_ops":
        per_token = layers * (attn_selective + mlp_selective + block_input)
        working = _tp_moe_replay(config, dims, stream, routing_imbalance)
    else:
        per_token = layers * (attn_full + mlp_full)
    working += _tp_moe_backward(config, dims, routing_imbalance) + _dense_mlp_backward(config, dims)
    kept_bytes, once = (per_token + first_input) * tokens, working * tokens
    if t == 1:  # rotary cos and sin, [seq_len, head_dim] each in the stream's width, shared by every layer
        kept_bytes += 2 * stream * m.head_dim * config.train.seq_len
    if has_loss_head:
        kept_bytes += head_kept_bytes(config, dims, loss_on_cpu)
        # the loss's buffers live inside its forward and backward, a recomputed block only in the blocks'
        # backward, after them: never both at once
        once = max(once, loss_head_bytes(config, dims, tokens, loss_on_cpu)[1])
    return kept_bytes, once


def _dense_mlp_backward(config: Config, dims: ParallelDims) -> float:
    """Bytes per token a dense SwiGLU MLP's backward holds at once beyond what the block keeps: the gradients of the
    gate and up outputs (2 w f / t) while the product's gradient is being freed. A rank peaks there when no loss head
    runs on it (a pipeline stage before the last): tiny dense model, pp 2 at seq 2,048, the first stage's peak is
    the first backward's MLP (BENCHMARKS.md, stop 31). 0 for an MoE: its block's backward is _tp_moe_backward's
    under tp; at tp 1 its stages' peaks measured within 5% without a backward term (pp 2 x ep 2 at seq 2k)."""
    m = config.model
    if m.is_moe:
        return 0.0
    return 2 * (2 if config.train.dtype == "bf16" else 4) * m.ffn_hidden / dims.tp


def _tp_moe_backward(config: Config, dims: ParallelDims, routing_imbalance: float = 1.0) -> float:
    """Bytes per token the backward of a tensor-parallel MoE layer's combine holds at once beyond what the block
    keeps (t > 1; 0 otherwise): the stream's gradient (w h / t), the block output's gradient gathered over tp (w h),
    the gradient of the rank's combined rows (w k h / t, times routing_imbalance), and the larger of the replayed
    forward's combine (the gathered input and the combined output, 2 w h) and the router's fp32 gradients (8 E).
    Attributed tensor by tensor on the tiny MoE at tp 2, seq 2,048 (BENCHMARKS.md, stop 30; the combine over all
    T k rows then)."""
    m, t = config.model, dims.tp
    if not m.is_moe or t == 1:
        return 0.0
    w, h = (2 if config.train.dtype == "bf16" else 4), m.d_model
    return w * h / t + w * h + routing_imbalance * w * m.top_k * h / t + max(2 * w * h, 8 * m.n_experts)


def _tp_moe_replay(config: Config, dims: ParallelDims, stream: int, routing_imbalance: float = 1.0) -> float:
    """Bytes per token selective_ops replays of a tensor-parallel MoE block in its backward, beyond what its
    policy keeps (t > 1; 0 otherwise): the attention's gathered input, normed input and q/k (with QK-norm, their
    normed copies), the MoE's normed stream, its gathered tokens, the router's and the rank's rows (without ep; the
    combine's input is the expert output the policy keeps)."""
    m, t = config.model, dims.tp
    if not m.is_moe or t == 1:
        return 0.0
    w, h, k = (2 if config.train.dtype == "bf16" else 4), m.d_model, m.top_k
    kv = m.kv_heads * m.head_dim
    attention = w * h + w * h / t + (2 if m.qk_norm else 1) * w * (h + kv) / t
    rows = routing_imbalance * w * k * h / t if dims.ep == 1 else 0.0
    moe = (stream + w) * h / t + w * h + 4 * m.n_experts + 8 * k + rows
    return attention + moe


def stream_width(config: Config, dims: ParallelDims) -> int:
    """Bytes per element of the residual stream between blocks: fp32 where the weights stay fp32 (the embedding's
    output is fp32, and a bf16 sub-layer output added to it promotes), even under bf16 autocast; the compute
    width where FSDP or the zero modes hand bf16 weights to the forward, or under train.compile (measured: Mula-1B
    on one H100 held 37.1 GiB compiled, 44.6 eager, and the eager count is within 0.2% of the eager run).
    """
    w = 2 if config.train.dtype == "bf16" else 4
    if config.train.compile:  # the compiled graph fuses the casts and norms and saves what it recomputes from
        return w
    return 4 if weights_stay_fp32(config, dims) else w


def forwards_first(config: Config, dims: ParallelDims) -> bool:
    """Whether every micro-batch's forward runs before the first backward (GPipe): each stage then holds all its
    micro-batches' activations, the LM head's loss state included, and no gradient beside them."""
    return dims.pp > 1 and config.parallel.pp_schedule == "gpipe"


def weights_stay_fp32(config: Config, dims: ParallelDims) -> bool:
    """Whether a rank's parameters are fp32 whatever it computes in: without data parallelism (one process, tp or pp
    alone) and under ddp; FSDP gathers bf16 weights (MixedPrecisionPolicy) and the zero modes keep bf16 parameters.
    Under bf16 compute autocast then casts them in every forward (autocast_weight_copy_bytes, the planner's
    step_time.weight_pass_bytes)."""
    return config.parallel.shard_mode == "ddp" or not dims.has_data_parallel


def autocast_weight_copy_bytes(config: Config, dims: ParallelDims, layers: int, has_loss_head: bool,
                               loss_on_cpu: bool = False) -> float:
    """bf16 copies of fp32 weights that autocast makes in the forward and autograd keeps for the backward.

    Only where a module's weights are fp32 when it computes in bf16: no FSDP (one process, tp or pp alone) and ddp;
    FSDP gathers its weights in bf16 already (MixedPrecisionPolicy) and the zero modes keep bf16 parameters. Not
    under train.compile: the compiled graph chooses what it saves (Mula-1B on an H200 held 7.5 GiB less compiled).
    Held once, whatever the micro-batches in flight (the copies are the weights', not the tokens'): every block's
    matrices (attention, dense MLP or the experts, whose fused op keeps its bf16 weights), those of the sub-modules
    a selective mask does not recompute plus one recomputed at a time, one block under full checkpointing; and the
    LM head on its stage where the loss is the plain F.cross_entropy of an accelerator. Measured: Mula-1B and
    Mula-7B-A1B's block on one H200 peaked 4.4 GiB above the model without them (2.2 and 3.4 GiB of copies).
    """
    m, t = config.model, dims.tp
    if config.train.dtype != "bf16" or config.train.compile or not weights_stay_fp32(config, dims):
        return 0.0
    h, kv = m.d_model, m.kv_heads * m.head_dim
    attention = (h * (h + 2 * kv) + h * h) / t
    if m.is_moe:
        mlp = m.n_experts * 3 * h * m.expert_ffn_hidden / (dims.ep * t) + h * m.n_experts
    else:
        mlp = 3 * h * m.ffn_hidden / t
    mode, recompute = config.train.activation_checkpointing, set(config.train.recompute)
    if mode == "full":
        kept = attention + mlp  # the block being recomputed
    elif mode == "selective":
        attention_again, mlp_again = "attention" in recompute, ("moe" if m.is_moe else "mlp") in recompute
        kept = layers * ((0 if attention_again else attention) + (0 if mlp_again else mlp))
        kept += max(attention if attention_again else 0, mlp if mlp_again else 0)
    else:
        kept = layers * (attention + mlp)
    head = m.vocab_size * h / t if has_loss_head and not loss_on_cpu else 0.0
    return 2.0 * (kept + head)


def _selective_layer(config: Config, dims: ParallelDims, attn_full: float, mlp_full: float) -> tuple[float, float]:
    """Bytes per token one block keeps under the selective mask, and the largest recomputed sub-module's
    full activations (held while it is recomputed); see activation_bytes."""
    m, t, recompute = config.model, dims.tp, set(config.train.recompute)
    h, kv = m.d_model, m.kv_heads * m.head_dim
    w = 2 if config.train.dtype == "bf16" else 4
    norm_h, qk = (4 + w) * h / t, (4 + w) * (h + kv) / t
    attn_body, mlp_body = attn_full - norm_h, mlp_full - norm_h
    kept_norm, recomputing = norm_h, 0.0
    if "norms" in recompute:
        kept_norm, recomputing = w * h / t, norm_h
        attn_body -= qk - w * (h + kv) / t
    if "attention" in recompute:
        attn_body, recomputing = w * h, max(recomputing, attn_full - norm_h)
    if ("moe" if m.is_moe else "mlp") in recompute:
        mlp_body, recomputing = w * h, max(recomputing, mlp_full - norm_h)
    return 2 * kept_norm + attn_body + mlp_body, recomputing


def checkpointing_modes(config: Config) -> dict[str, Config]:
    """The config under each activation-checkpointing mode, keyed by a label (selective names its mask)."""
    modes = {"none": "none", f"selective {'+'.join(config.train.recompute) or '-'}": "selective", "selective_ops": "selective_ops",
             "full": "full"}
    return {label: config.model_copy(update={"train": config.train.model_copy(update={"activation_checkpointing": mode})})
            for label, mode in modes.items()}


def step_batch(config: Config, dims: ParallelDims) -> BatchLayout:
    """The step's batch split as the trainer makes it (the micro-batch derived when not configured)."""
    return resolve_batch(config.train, dims, config.parallel.pp_schedule)


def micro_batches_in_flight(config: Config, dims: ParallelDims, stage: int) -> float:
    """Micro-batches whose activations pipeline stage `stage` holds at once, in units of the whole stage's layers.

    GPipe: all of the rank's micro-batches. 1F1B: the warm-up depth pp - stage, so the first stage holds the most.
    Interleaved 1F1B (v virtual stages of layers / v each): torch's warm-up of (v - 1) x (micro-batches per round)
    + 2 (pp - 1 - stage) chunk forwards plus the first steady one (ScheduleInterleaved1F1B's _get_warmup_ops),
    over v: rank 0 of pp = 32, v = 2 holds 47.5 stages' worth, not 32. No pipeline: one at a time.
    """
    n_micro = step_batch(config, dims).micro_batches
    if dims.pp == 1:
        return 1
    if config.parallel.pp_schedule == "gpipe":
        return n_micro
    virtual = config.parallel.pp_virtual_stages
    if config.parallel.pp_schedule == "interleaved_1f1b" and virtual > 1:
        per_round = n_micro // max(1, n_micro // dims.pp)
        warmup = min((virtual - 1) * per_round + 2 * (dims.pp - 1 - stage), n_micro * virtual)
        return min(n_micro, (warmup + 1) / virtual)
    return min(n_micro, dims.pp - stage)
