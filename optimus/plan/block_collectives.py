"""The collectives inside a block, per micro-batch, for the step-time model (step_time.py): what each
activation-checkpointing mode runs again of them (replayed_collectives), tensor parallelism's (sequence-parallel
gathers and scatters, QK-norm's all-reduces, the vocab-parallel head's) and expert parallelism's dispatch and
combine (all_to_all, or the allgather dispatch's gathers and reduce-scatter), each priced by the alpha-beta model
of comms.py on the mesh dimension's link. Where a collective reached after compute costs more by how long the
ranks computed before it (`here`: Cluster.collective_sync), tensor parallelism's calls are priced each at the compute
before it in the block's order (TensorParallelGaps): half of them follow a few small operators, not a GEMM."""

from __future__ import annotations

from dataclasses import dataclass, replace

from optimus.config import Config
from optimus.ops.cross_entropy import DEFAULT_CHUNK_ROWS
from optimus.parallel.mesh import ParallelDims
from optimus.plan.cluster import Cluster
from optimus.plan.comms import all_reduce_time, all_to_all_time, group_link, ring_time, sync_after_compute


@dataclass(frozen=True)
class ReplayedCollectives:
    """The collectives one block's recompute runs again (counted by dispatching the backward on gloo, where
    tests/distributed/test_checkpointing_collectives.py checks every mode against these).

    tp_gathers, tp_scatters: sequence parallelism's all-gathers and reduce-scatters of activations (forward hooks
        around attention and the MLP, which run outside a recomputed sub-module; a recompute stops at the last
        activation the backward needs, so a MoE block's closing reduce-scatter is not run again)
    qk_norm: QK-norm's all-reduces (q and k), inside attention (op-level checkpointing keeps their output)
    ep: the MoE layer's exchanges run again: "all" (routing counts, dispatch and combine), "gather" (the allgather
        dispatch's all-gathers of the tokens and router weights: op-level checkpointing keeps the rest), or "none"
    """

    tp_gathers: int = 0
    tp_scatters: int = 0
    qk_norm: int = 0
    ep: str = "none"


def replayed_collectives(config: Config) -> ReplayedCollectives:
    """What the train.activation_checkpointing mode runs again of a block's collectives (ReplayedCollectives)."""
    mode, moe = config.train.activation_checkpointing, config.model.is_moe
    if mode == "full":
        return ReplayedCollectives(tp_gathers=2, tp_scatters=1 if moe else 2, qk_norm=2, ep="all")
    if mode == "selective_ops":
        return ReplayedCollectives(tp_gathers=2, ep="gather")
    if mode == "selective":
        recompute = set(config.train.recompute)
        # QK-norm runs again inside a recomputed attention, or as its own recomputed norms
        qk = 2 if "attention" in recompute or "norms" in recompute else 0
        return ReplayedCollectives(qk_norm=qk, ep="all" if moe and "moe" in recompute else "none")
    return ReplayedCollectives()


@dataclass(frozen=True)
class TensorParallelGaps:
    """One micro-batch's forward seconds on a tensor-parallel rank that come before each of a block's collectives;
    the backward runs each segment again at twice the cost before the mirrored call (the all-gather's gradient is a
    reduce-scatter and vice versa).

    qkv: a layer's q, k and v projections; attention: its attention core and output projection; mlp: its MLP or
    MoE layer (0 where expert parallelism's combine comes between: the closing reduce-scatter follows that
    exchange); between: a layer's other forward work (norms, residual adds, activations, operator dispatch), spread
    evenly over its calls; head: the LM head's and the loss's forward.
    """

    qkv: float
    attention: float
    mlp: float
    between: float
    head: float


def norm_gradient_reduces(config: Config, dims: ParallelDims, layers: int) -> int:
    """tp all-reduces of the sequence-parallel norms' gradients one micro-batch runs on the last stage.

    The norms' replicated weights see only their rank's tokens, so their gradients leave the backward as Partial
    sums over tp (parallel/partial_grads.py). Under FSDP each unit's post-backward redistributes every such gradient
    to its parameter's placement before it reduces over dp: one all-reduce per weight in every micro-batch (each
    block's attention and MLP norms and the final norm: 9 a micro-batch in the 4-layer tiny models' profiles at
    dp 2 x tp 2, counted by tests/distributed/test_norm_gradient_reduces.py). The other shard modes keep them
    Partial through the micro-batches and sum them all in one all-reduce a step (train/step.py)."""
    if dims.tp == 1 or config.parallel.shard_mode != "fsdp" or not dims.has_data_parallel:
        return 0
    return 2 * layers + 1


def _loss_chunks(config: Config) -> int:
    """The chunks of rows the vocab-parallel loss works through in one micro-batch (ops/cross_entropy.py)."""
    tokens = config.train.micro_batch_size * config.train.seq_len
    return -(-tokens // min(DEFAULT_CHUNK_ROWS, tokens))


def tensor_parallel_call_gaps(config: Config, dims: ParallelDims, layers: int, again: ReplayedCollectives,
                              gaps: TensorParallelGaps) -> list[float]:
    """The compute before each of one micro-batch's tensor-parallel collectives (tensor_parallel_time's calls, in
    the block's order; profiled on the tiny dense model at tp 2: all-gather, 3.5 ms of q/k/v projections, q's
    all-reduce, 0.3 ms, k's, 4 ms of attention, reduce-scatter, 0.9 ms, all-gather, 11 ms of MLP, reduce-scatter)."""
    m, mode = config.model, config.train.activation_checkpointing
    calls = 6 if m.qk_norm else 4
    b = gaps.between / calls
    if m.qk_norm:
        attention = [gaps.qkv + b, b, gaps.attention + b]  # q's all-reduce, k's, the reduce-scatter
    else:
        attention = [gaps.qkv + gaps.attention + b]
    forward = [b, *attention, b, gaps.mlp + b]
    scatters = [attention[-1], gaps.mlp + b]
    # what the recompute runs again: the gathers after a few operators, the scatters and QK-norm's all-reduces after
    # the GEMMs they follow where those run again too (full; selective's recomputed attention)
    recomputes_attention = mode == "full" or (mode == "selective" and "attention" in config.train.recompute)
    qk_again = [gaps.qkv + b, b] if recomputes_attention else [b, b]
    replayed = [b] * again.tp_gathers + scatters[:again.tp_scatters] + qk_again[:again.qk_norm]
    block = forward + [2 * g for g in forward] + replayed
    chunks = _loss_chunks(config)
    head = [b] + [gaps.head / chunks] * chunks + [2 * gaps.head]  # gather, each chunk's statistics, scatter back
    embedding = [b, b] if dims.pp == 1 else []
    # under FSDP the norms' gradient all-reduces follow each block's backward and each other after a few operators
    # (profiled: 0.4-0.6 ms after the block's last reduce-scatter, 0.1-0.4 ms apart), the final norm's the head's
    norms = [b] * norm_gradient_reduces(config, dims, layers)
    return block * layers + head + embedding + norms


def tensor_parallel_time(config: Config, dims: ParallelDims, cluster: Cluster, layers: int, act_bytes: float,
                         again: ReplayedCollectives, gaps: TensorParallelGaps | None = None) -> float:
    """One micro-batch's tensor-parallel collectives on the last pipeline stage (parallel/tensor_parallel.py).

    Per block: an all-gather before and a reduce-scatter after attention and the MLP (sequence parallel), each
    mirrored in backward (the all-gather's gradient is a reduce-scatter and vice versa), and what the recompute
    runs again (replayed_collectives); QK-norm's full-width RMS all-reduces each token's sum of squares for q and
    k, forward and backward. The root: the embedding's output reduce-scattered to sequence shards (an all-gather
    back), the LM head's input all-gathered (a reduce-scatter back), and one all-gather of the loss's [2, rows]
    statistics per chunk. Under FSDP, the norms' gradients summed over tp one weight at a time
    (norm_gradient_reduces).

    gaps: where the cluster timed what a call reached after compute costs (Cluster.collective_sync), each call pays
    that at the compute before it (tensor_parallel_call_gaps) instead of the link's one sync for every call.
    """
    m, train = config.model, config.train
    link = group_link(dims, ("tp",), cluster)
    per_gap = 0.0
    if gaps is not None and link.measured and cluster.collective_sync:
        link = replace(link, sync=0.0)
        per_gap = sum(sync_after_compute(cluster.collective_sync, gap)
                      for gap in tensor_parallel_call_gaps(config, dims, layers, again, gaps))
    gather, scatter = ring_time(link, act_bytes), ring_time(link, act_bytes, "reduce_scatter")
    gather_scatter = gather + scatter
    tokens = train.micro_batch_size * train.seq_len
    blocks = layers * (2 * 2 * gather_scatter + again.tp_gathers * gather + again.tp_scatters * scatter)
    qk_norm = layers * (2 * 2 + again.qk_norm) * all_reduce_time(link, 4 * tokens) if m.qk_norm else 0.0
    rows = min(DEFAULT_CHUNK_ROWS, tokens)
    head = gather_scatter + _loss_chunks(config) * ring_time(link, dims.tp * 2 * 4 * rows)
    # the stage priced is the last (it holds the head); without a pipeline it holds the embedding too
    embedding = gather_scatter if dims.pp == 1 else 0.0
    # a norm weight's gradient is d_model elements in the compute dtype: one token's row of the activations
    norms = norm_gradient_reduces(config, dims, layers) * all_reduce_time(link, act_bytes / tokens)
    return blocks + qk_norm + head + embedding + norms + per_gap


def allgather_exchange_bytes(ep: int, act_bytes: float, tokens: int, top_k: int) -> dict[str, float]:
    """Bytes each all-gather of the allgather dispatch brings in per MoE layer and micro-batch (its reduce-scatter
    of the combined outputs is given as many as the tokens'): every rank's `tokens` (act_bytes of them) with their
    fp32 router weights, int64 expert ids and the ranks' token counts (parallel/expert_parallel.py)."""
    copies = ep * tokens * top_k
    return {"tokens": ep * act_bytes, "router_weights": 4 * copies, "expert_ids": 8 * copies, "token_counts": 8 * ep}


def expert_parallel_time(config: Config, dims: ParallelDims, cluster: Cluster, layers: int, tokens: int,
                          act_bytes: float, again: ReplayedCollectives) -> float:
    """Per micro-batch on a stage: each MoE layer's dispatch and combine, forward and backward, and what the
    recompute runs again."""
    link = group_link(dims, ("ep",), cluster)
    if config.parallel.ep_dispatch == "all_to_all":
        dispatch = combine = all_to_all_time(link, act_bytes * config.model.top_k / dims.tp, cluster)
        # the forward first exchanges each expert's row count (int64) to size the uneven exchange; the backward
        # reuses those splits
        counts = all_to_all_time(link, 8 * config.model.n_experts, cluster)
        forward, backward = counts + dispatch + combine, dispatch + combine
        gathers = 0.0
    else:  # ep x the rank's tokens each way (the whole micro-batch's under tp: sequence parallelism gathered them
        # for the block); the backward reverses the differentiable gathers and the combine
        sizes = allgather_exchange_bytes(dims.ep, act_bytes, tokens, config.model.top_k)
        gathers = ring_time(link, sizes["tokens"]) + ring_time(link, sizes["router_weights"])
        combine = ring_time(link, sizes["tokens"], "reduce_scatter")
        forward = gathers + ring_time(link, sizes["expert_ids"]) + ring_time(link, sizes["token_counts"]) + combine
        backward = (ring_time(link, sizes["tokens"], "reduce_scatter") + ring_time(link, sizes["tokens"])
                    + ring_time(link, sizes["router_weights"], "reduce_scatter"))
    # what the recompute runs again: the whole exchange, or (op-level) the allgather's differentiable all-gathers
    replayed = {"all": forward, "gather": gathers}
    return layers * (forward + backward + replayed.get(again.ep, 0.0))
