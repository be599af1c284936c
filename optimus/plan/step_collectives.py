"""The step's own small collectives: what the trainer reduces once a step outside the blocks' and the gradients'
traffic, each a few bytes and so a call's latency (plus, where the cluster timed it, what a call reached after
compute costs: here.py's sync).

    loss terms       train/step.average_over_dp: the loss terms averaged, and an MoE's expert counts summed, over
                     the data-parallel ranks (fp32), one all-reduce
    pipeline terms   parallel/pipeline (_gather_terms): the same terms and every layer's counts over pp (fp64)
    gradient norm    train/step.clip_gradients: one all-reduce per distinct set of ranks that shards a gradient
                     (FSDP's dp_shard, the experts' own FSDP ranks where ep splits dp_shard, tp, ep), then one over
                     pp; zero1/zero2 (optim/sharded.py): one over the whole job
    partial sums     parallel/partial_grads: the sequence-parallel norms' Partial gradients summed over tp once a
                     step in one flat all-reduce, where FSDP's post-backward does not redistribute each one in every
                     micro-batch (block_collectives.norm_gradient_reduces)
    preemption       train/callbacks/resilience.PreemptionCheckpoint: after each step, whether any rank received a
                     signal (resilience.checkpoint_on_signal), over the whole job
    memory           train/callbacks/step_metrics.MemoryMetrics: each logged step, every rank's peak gathered
    expert load      ExpertLoadMetrics: each logged step where ep or tp split the experts among several
                     exchange groups, the counts summed over ep and the busiest group's share maxed over expert_dp
    stragglers       resilience/stragglers: every straggler_every steps, every rank's mean step time gathered

Counted against a real step on gloo: tests/distributed/test_step_collectives.py. Latency-bound: over a group that
spans nodes, NCCL, RCCL and oneCCL reduce a few bytes along a tree (2 log2 hops), not a ring (2 (n - 1) hops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from optimus.config import Config
from optimus.parallel.mesh import MESH_DIMS, ParallelDims
from optimus.plan.block_collectives import norm_gradient_reduces
from optimus.plan.cluster import Cluster
from optimus.plan.comms import Link, all_reduce_time, group_link, mesh_sizes, ring_time, sync_after_compute

LOSS_TERMS = 4  # loss, ce_loss, aux_loss, z_loss (a dense model's two are as few bytes)
DP = ("dp_replicate", "dp_shard_mod_ep", "ep")
EXPERT_DP = ("dp_replicate", "dp_shard_mod_ep")


@dataclass(frozen=True)
class StepCollective:
    """One of the step's small collectives: `op` (all_reduce or all_gather) over the mesh dims `group`, `nbytes`
    (an all-gather's gathered size), `per_step` calls a step on average (a logged step's: 1 / log_every)."""

    what: str
    op: str
    group: tuple[str, ...]
    nbytes: float
    per_step: float = 1.0
    after_update: bool = False  # a callback's, after the optimizer's update (else after the backward's collectives)


def gradient_norm_groups(config: Config, dims: ParallelDims) -> list[tuple[str, ...]]:
    """The mesh dims of each all-reduce the gradient clipping's norm runs (see the module)."""
    sizes = mesh_sizes(dims)
    if config.parallel.shard_mode in ("zero1", "zero2"):
        return [MESH_DIMS] if dims.world_size > 1 else []
    sets: list[tuple[str, ...]] = []
    if config.parallel.shard_mode == "fsdp":
        sets.append(("dp_shard_mod_ep", "ep"))  # FSDP's non-expert weights, and an MoE's experts without ep
        if config.model.is_moe and dims.ep > 1:
            sets.append(("dp_shard_mod_ep",))  # the experts' own FSDP ranks
    if config.model.is_moe and dims.ep > 1:
        sets.append(("ep",))
    sets.append(("tp",))
    # a set's dims of one rank drop out; two sets of the same ranks are one call (train/step._global_squares)
    distinct = dict.fromkeys(tuple(d for d in group if sizes[d] > 1) for group in sets)
    return [group for group in distinct if group] + ([("pp",)] if dims.pp > 1 else [])


def step_collectives(config: Config, dims: ParallelDims, layers: int) -> list[StepCollective]:
    """Every small collective one step of `config` laid out as `dims` runs (see the module); `layers`: the last
    pipeline stage's blocks."""
    m, train, r = config.model, config.train, config.resilience
    counts = m.n_layers * m.n_experts if m.is_moe else 0
    calls = [StepCollective("gradient norm", "all_reduce", group, 4) for group in gradient_norm_groups(config, dims)]
    if dims.dp > 1:
        calls.append(StepCollective("loss terms", "all_reduce", DP, 4 * (LOSS_TERMS + counts)))
    if dims.pp > 1:
        calls.append(StepCollective("pipeline terms", "all_reduce", ("pp",), 8 * (LOSS_TERMS - 1 + counts)))
    if dims.tp > 1 and not norm_gradient_reduces(config, dims, layers):
        calls.append(StepCollective("partial sums", "all_reduce", ("tp",), 4 * (2 * layers + 1) * m.d_model))
    logged = 1 / train.log_every
    if dims.world_size > 1:
        if r.checkpoint_on_signal:
            calls.append(StepCollective("preemption", "all_reduce", MESH_DIMS, 4, after_update=True))
        calls.append(StepCollective("memory", "all_gather", MESH_DIMS, 8 * dims.world_size, logged, True))
        if r.straggler_every:
            calls.append(StepCollective("stragglers", "all_gather", MESH_DIMS, 4 * dims.world_size,
                                        1 / r.straggler_every, True))
    if m.is_moe and dims.ep * dims.tp > 1 and dims.dp_replicate * dims.dp_shard_mod_ep > 1:
        if dims.ep > 1:
            calls.append(StepCollective("expert load", "all_reduce", ("ep",), 8 * counts, logged, True))
        calls.append(StepCollective("expert load", "all_reduce", EXPERT_DP, 16, logged, True))
    return calls


def _tree_all_reduce(link: Link, nbytes: float) -> float:
    """A few bytes reduced up a tree and broadcast back down: log2 hops each way, on node and across nodes."""
    hops_on_node = math.ceil(math.log2(link.per_node)) if link.per_node > 1 else 0
    hops_across = math.ceil(math.log2(link.nodes)) if link.spans_nodes else 0
    return 2 * (hops_on_node * (link.intra_alpha + nbytes / link.intra_beta) +
                hops_across * (link.inter_alpha + nbytes / link.inter_beta))


def step_collectives_time(config: Config, dims: ParallelDims, cluster: Cluster, layers: int,
                          update_s: float | None = None) -> float:
    """Seconds a step spends in its small collectives (step_collectives): latency-bound, after the backward or
    between steps, so nothing hides them. A measured link (`here`) answers from its timed table, back to back:
    they follow the backward's collectives and each other within a few operators. Given `update_s`, the optimizer's
    update, the first call after it pays what a collective reached after that much compute costs (the cluster's
    collective_sync), once a step. (Profiled on the 2-core EPYC, 4 steps: dense FSDP x tp on 4 ranks spent 11-21
    ms a step in its 5, dense FSDP on 2 ranks 3.2-4.5 ms in its 4, where every call paying the sync at the step's
    mean compute gap priced 20.5 and 10.6 ms.)"""
    # back to back: no call pays the step's mean-gap sync (collective_sync_s)
    calls = [(call, group_link(dims, call.group, cluster)) for call in step_collectives(config, dims, layers)]
    calls = [(call, replace(link, sync=0.0) if link.sync else link) for call, link in calls if link.size > 1]
    total = 0.0
    after = [call.per_step for call, _ in calls if call.after_update]
    if update_s is not None and cluster.collective_sync and after:  # in the steps that run any (all, or logged)
        total += sync_after_compute(cluster.collective_sync, update_s) * min(1.0, max(after))
    for call, link in calls:
        if call.op == "all_gather":
            seconds = ring_time(link, call.nbytes, "all_gather")
        else:
            seconds = all_reduce_time(link, call.nbytes)
            if not link.measured:
                seconds = min(seconds, _tree_all_reduce(link, call.nbytes))
        total += seconds * call.per_step
    return total
