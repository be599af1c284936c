"""The collectives inside a block, per micro-batch, for the step-time model (step_time.py): what each
activation-checkpointing mode runs again of them (replayed_collectives), tensor parallelism's (sequence-parallel
gathers and scatters, QK-norm's all-reduces, the vocab-parallel head's) and expert parallelism's dispatch and
combine (all_to_all, or the allgather dispatch's gathers and reduce-scatter), each priced by the alpha-beta model
of comms.py on the mesh dimension's link."""

from __future__ import annotations

from dataclasses import dataclass

from optimus.config import Config
from optimus.ops.cross_entropy import DEFAULT_CHUNK_ROWS
from optimus.parallel.mesh import ParallelDims
from optimus.plan.cluster import Cluster
from optimus.plan.comms import all_reduce_time, all_to_all_time, group_link, ring_time


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


def tensor_parallel_time(config: Config, dims: ParallelDims, cluster: Cluster, layers: int, act_bytes: float,
                          again: ReplayedCollectives) -> float:
    """One micro-batch's tensor-parallel collectives on the last pipeline stage (parallel/tensor_parallel.py).

    Per block: an all-gather before and a reduce-scatter after attention and the MLP (sequence parallel), each
    mirrored in backward (the all-gather's gradient is a reduce-scatter and vice versa), and what the recompute
    runs again (replayed_collectives); QK-norm's full-width RMS all-reduces each token's sum of squares for q and
    k, forward and backward. The root: the embedding's output reduce-scattered to sequence shards (an all-gather
    back), the LM head's input all-gathered (a reduce-scatter back), and one all-gather of the loss's [2, rows]
    statistics per chunk.
    """
    m, train = config.model, config.train
    link = group_link(dims, ("tp",), cluster)
    gather, scatter = ring_time(link, act_bytes), ring_time(link, act_bytes, "reduce_scatter")
    gather_scatter = gather + scatter
    tokens = train.micro_batch_size * train.seq_len
    blocks = layers * (2 * 2 * gather_scatter + again.tp_gathers * gather + again.tp_scatters * scatter)
    qk_norm = layers * (2 * 2 + again.qk_norm) * all_reduce_time(link, 4 * tokens) if m.qk_norm else 0.0
    rows = min(DEFAULT_CHUNK_ROWS, tokens)
    head = gather_scatter + -(-tokens // rows) * ring_time(link, dims.tp * 2 * 4 * rows)
    # the stage priced is the last (it holds the head); without a pipeline it holds the embedding too
    embedding = gather_scatter if dims.pp == 1 else 0.0
    return blocks + qk_norm + head + embedding


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
