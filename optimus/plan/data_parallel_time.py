"""Data parallelism's share of a step, for the step-time model (step_time.py): what FSDP, HSDP, DDP and the zero
modes move between the ranks each micro-batch and each step, what of it compute can hide, the copies in and out of
their buffers, which nothing hides, and the parameters each rank then updates.

    FSDP     each unit (a block, under ep its experts, the root: embedding, final norm, head) all-gathers its
             parameters in the compute dtype (fsdp_gathers_per_micro_batch: twice a block and micro-batch without
             pp, fewer under pp) and reduce-scatters its gradients in parallel.grad_reduce_dtype (fp32, or bf16 at
             half the bytes) every micro-batch, of every rank's padded shard (memory.fsdp_elements): beside the
             micro-batch's compute, which hides them where links run beside it. Under pp torch's schedules defer the
             reduce-scatter to once a step after the last backward, where nothing hides it; under
             defer_grad_sync=all (no pp, several micro-batches) it runs once a step in the last micro-batch's
             backward
    HSDP     each unit's reduced shard is all-reduced over dp_replicate as its backward ends (FSDP2's
             foreach_reduce), one call per unit: in the last micro-batch's backward (every micro-batch's under
             defer_grad_sync=none), after the last backward under pp
    DDP      one all-reduce of the whole gradients a step, bucket by bucket (ddp_bucket_bytes: torch DDP's 25 MiB)
             as the last backward (about 2/3 of its compute) produces them, every micro-batch's under
             defer_grad_sync=none; with bf16 reduction its comm hook's casts
    zero1/2  a reduce-scatter of the gradients (zero2: in every micro-batch's backward, which hides 2/3 of its
             compute; zero1: once a step) and an all-gather of the updated parameters, per bucket
             (memory.zero_bucket_sizes: 40M elements), each paying its ring's latency (over a 128-node ring,
             220B-A10B on 12,288 Aurora tiles, 0.15 s of a 1.0 s sync); the EP-unaware baseline also all-reduces
             its non-expert shard over ep in fp32
    copies   FSDP's copies in and out of its communication buffers (per micro-batch; under pp or
             defer_grad_sync=all the gradients' once a step), on a host CPU also the page faults of those buffers
             and of unsharded weights of 32 MiB or more, which glibc maps afresh each time (fsdp_fresh_bytes); the
             zero modes' packing of gradients into their buffers (per reduction) and unpacking of the gathered
             parameters (per step): memory-bound work on the rank; zero2's sums of its later reductions into the
             fp32 shards at the rate of an in-place sum (the optimizer class's, as autograd's accumulation)
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from optimus.config import Config
from optimus.parallel.data_parallel import DDP_BUCKET_CAP_MB, DDP_FIRST_BUCKET_BYTES
from optimus.parallel.mesh import ParallelDims
from optimus.plan.cluster import Cluster
from optimus.plan.comms import Link, all_reduce_time, group_link, ring_time
from optimus.plan.memory import ModelShape, fsdp_elements, fsdp_gathered_block, zero_bucket_sizes


@dataclass(frozen=True)
class DataParallelTime:
    """Data parallelism's seconds in one step, by where they fall.

    overlappable_mb: collectives per micro-batch that compute can hide (FSDP's gathers and reduce-scatters, HSDP's
        all-reduces under defer_grad_sync=none); only what exceeds the micro-batch's compute shows
    last_backward: collectives once a step in the last micro-batch's backward (FSDP's reduce-scatter under
        defer_grad_sync=all, HSDP's all-reduces), which that backward's compute can hide
    exposed_mb: collectives per micro-batch already net of what hides them (zero2's reduce-scatter)
    copies_mb, copies_step: buffer copies per micro-batch and per step, never hidden
    step_sync: collectives after the last backward, never hidden (under pp FSDP's reduce-scatter and HSDP's
        all-reduce; ddp's beyond the backward that hides it; the zero modes' reductions and parameter gathers)
    owned: parameters (elements) this rank's optimizer updates
    """

    overlappable_mb: float = 0.0
    last_backward: float = 0.0
    exposed_mb: float = 0.0
    copies_mb: float = 0.0
    copies_step: float = 0.0
    step_sync: float = 0.0
    owned: float = 0.0


def fsdp_gathers_per_micro_batch(layers: int, micro_batches: int, pp: int, virtual: int) -> tuple[float, float]:
    """FSDP all-gathers per micro-batch of each of a rank's `layers` blocks and of its root (embedding, final norm,
    head), averaged over the step's micro-batches.

    Without pp: two for a block (its forward, again for its backward), one for the last block and the root, which
    stay gathered from their forward to their backward (parallel/data_parallel.py). Under pp torch's schedules keep
    a unit gathered from its first backward to the step's end (reshard after backward off until the last
    micro-batch): each of the `virtual` stage modules gathers its l - 1 resharding blocks once per forward and once
    more for the first backward, its last block and the root once a step. Counted (gloo all-gathers of a profiled
    MoE PP 2 + EP 2 step): 4, 6, 7 and 11 block gathers for l = 2, 2, 3, 3 blocks and m = 2, 4, 2, 4 micro-batches,
    8 for two virtual stages of 2 blocks at m = 2, 1 root gather each time; the per-micro-batch count priced 60%
    more at l = 2.
    """
    if pp == 1:
        return (2 * layers - 1) / layers, 1.0
    per_module = layers / virtual
    per_step = virtual * ((per_module - 1) * (micro_batches + 1) + 1)
    return per_step / (layers * micro_batches), 1.0 / micro_batches


def fsdp_fresh_bytes(shape: ModelShape, dims: ParallelDims, width: int, threshold: int, layers: int,
                     gathers: tuple[float, float], reduce: float = 4.0) -> tuple[float, float]:
    """(per micro-batch's all-gathers, per reduction) bytes of FSDP's buffers of `threshold` bytes or more, which a
    host allocator that hands such blocks back to the kernel on free (glibc) pages in afresh every time: each
    all-gather's output and the unsharded weights it is copied out into, each reduce-scatter's input and output
    (`reduce` bytes an element: fp32 4, bf16 2). `gathers`: (per block, for the root) all-gathers per micro-batch,
    as step_time counts them; each of the stage's units reduces once per reduction. Under pp the last stage's (the
    LM head's) root."""
    def fresh(nbytes: float) -> float:
        return nbytes if nbytes >= threshold else 0.0

    units: dict[str, list] = {"block": [], "experts": [], "root": []}
    for tensor in shape.tensors:
        # the experts are a unit of their own only under ep (parallelize.py); without it, in their block's buffers
        unit = "experts" if tensor.expert and dims.ep > 1 else "block" if tensor.where == "block" else "root"
        if unit != "root" or tensor.on_stage(first=dims.pp == 1, last=True):
            units[unit].append(tensor)
    gathers = {"block": layers * gathers[0], "experts": layers * gathers[0], "root": gathers[1]}
    reduces = {"block": layers, "experts": layers, "root": 1}
    per_gather = per_reduce = 0.0
    for unit, tensors in units.items():
        if not tensors:
            continue
        ranks = dims.dp_shard_mod_ep if unit == "experts" else dims.dp_shard
        gathered = sum(fsdp_elements(t, dims)[1] for t in tensors)
        copied_out = sum(fresh(width * math.prod(t.local_shape(dims))) for t in tensors)
        per_gather += gathers[unit] * (fresh(width * gathered) + copied_out)
        per_reduce += reduces[unit] * (fresh(reduce * gathered) + fresh(reduce * gathered / ranks))
    return per_gather, per_reduce


def ddp_bucket_bytes(gradient_bytes: float) -> list[float]:
    """torch DDP's gradient buckets: a small first one, then bucket_cap_mb each (parallel/data_parallel.py), the
    last short; each is one all-reduce."""
    first, cap = DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_MB * 2 ** 20
    if gradient_bytes <= first:
        return [gradient_bytes]
    full, tail = divmod(gradient_bytes - first, cap)
    return [first] + [cap] * int(full) + ([tail] if tail else [])


def _per_bucket(collective_time, groups: list[tuple[Link, list[float]]]) -> float:
    """The time of one collective per bucket (a size, over its group's link), one after another; equal buckets
    priced once (the search prices tens of thousands of layouts, each with dozens of buckets)."""
    return sum(count * collective_time(link, size) for link, sizes in groups for size, count in Counter(sizes).items())


@dataclass(frozen=True)
class _Stage:
    """The parameters (elements) of one pipeline stage a rank holds before data parallelism splits them (still
    split over tp and ep): its blocks' dense and expert ones, and the root's (embedding, final norm, head; under pp
    the larger of the first stage's and the last's)."""

    layers: int
    root: float
    dense: float  # the blocks' dense parameters and the root's
    experts: float

    @classmethod
    def of(cls, shape: ModelShape, dims: ParallelDims, layers: int) -> _Stage:
        root = (shape.embedding + shape.head if dims.pp == 1 else max(shape.embedding, shape.head)) / dims.tp
        dense = layers * (shape.block_tp_split / dims.tp + shape.block_replicated) + root
        return cls(layers, root, dense, layers * shape.block_experts / (dims.ep * dims.tp))


def data_parallel_time(config: Config, dims: ParallelDims, shape: ModelShape, cluster: Cluster, layers: int,
                       micro_batches: int, hidden_by_backward: float, copy_rate: float,
                       sum_rate: float) -> DataParallelTime:
    """Data parallelism's share of one step of `config` (resolved: its dtype as the trainer runs it) laid out as
    `dims`, for a stage of `layers` blocks (the last: with the LM head). hidden_by_backward: what a micro-batch's
    backward hides of a collective (zero where the ranks' own cores move the bytes); copy_rate: the bytes a second
    its buffer copies move on a rank (Efficiency.buffer_copy); sum_rate: the bytes a second of an in-place sum into
    fp32 gradients (zero2's reduced shards added up; the optimizer class's rate, as step_time prices autograd's and
    FSDP's gradient sums)."""
    stage = _Stage.of(shape, dims, layers)
    if config.parallel.shard_mode == "fsdp":
        return _fsdp_time(config, dims, shape, cluster, stage, micro_batches, copy_rate)
    if config.parallel.shard_mode == "ddp":
        return _ddp_time(config, dims, cluster, stage, micro_batches, hidden_by_backward, copy_rate)
    return _zero_time(config, dims, shape, cluster, stage, micro_batches, hidden_by_backward, copy_rate, sum_rate)


def _fsdp_time(config: Config, dims: ParallelDims, shape: ModelShape, cluster: Cluster, stage: _Stage,
               micro_batches: int, copy_rate: float) -> DataParallelTime:
    """FSDP and HSDP (the module docstring says what runs when)."""
    p, layers, root = config.parallel, stage.layers, stage.root
    width, grad_width = _widths(config)
    shard_link = group_link(dims, ("dp_shard_mod_ep", "ep"), cluster)
    expert_link = group_link(dims, ("dp_shard_mod_ep",), cluster)
    # defer_grad_sync=all (parallel/data_parallel.set_gradient_sync): FSDP accumulates whole gradients, in its reduce
    # dtype, and reduce-scatters them once, in the last micro-batch's backward
    defer_all = dims.pp == 1 and p.defer_grad_sync == "all" and micro_batches > 1
    # per FSDP unit (each block, and the root: embedding, head, final norm) all-gathers in the compute dtype
    # (fsdp_gathers_per_micro_batch: two a block and micro-batch without pp, fewer under pp); and one reduce-scatter
    # per micro-batch, under pp deferred by torch's schedules to once per step, after the last backward
    # (stage.perform_reduce_grad), where nothing hides it, and under defer_grad_sync=all to the last micro-batch's
    # backward
    block_gathers, root_gathers = fsdp_gathers_per_micro_batch(layers, micro_batches, dims.pp, p.pp_virtual_stages)

    def unit_calls(dense: float, experts: float) -> list[tuple[Link, float]]:
        """A unit's collectives as (group, elements): its experts are a unit of their own only under ep, where
        parallelize.py gives them their mesh; without ep they travel in their block's call (one call's latency)."""
        return [(shard_link, dense), (expert_link, experts)] if dims.ep > 1 else [(shard_link, dense + experts)]

    def unit_gathers(dense: float, experts: float, gathers: float) -> float:
        return gathers * sum(ring_time(link, width * n) for link, n in unit_calls(dense, experts))

    def unit_reduce(dense: float, experts: float) -> float:
        return sum(ring_time(link, grad_width * n, "reduce_scatter") for link, n in unit_calls(dense, experts))
    block_dense, block_experts = fsdp_gathered_block(shape, dims)  # FSDP2's padded shards included
    per_mb = layers * unit_gathers(block_dense, block_experts, block_gathers) + unit_gathers(root, 0.0, root_gathers)
    reduce = layers * unit_reduce(block_dense, block_experts) + unit_reduce(root, 0.0)
    gather_copies = reduce_copies = 0.0
    if dims.has_data_parallel:  # and their copies, which no link hides (without data parallelism the trainer
        # applies no FSDP): each all-gather copies the shard in and the whole unit out, the reduce-scatter copies the
        # whole gradients into its input (read as backward wrote them, in the compute dtype, or under pp or
        # defer_grad_sync=all as FSDP accumulated them, in the reduce dtype; written in the reduce dtype)
        blocks_dense = stage.dense - root
        gathered_now = block_gathers * (blocks_dense + stage.experts) + root_gathers * root
        owned_now = (block_gathers * (blocks_dense / dims.dp_shard + stage.experts / dims.dp_shard_mod_ep) +
                     root_gathers * root / dims.dp_shard)
        gather_copies = 2 * width * (gathered_now + owned_now) / copy_rate
        read_width = grad_width if dims.pp > 1 or defer_all else width
        reduce_copies = (read_width + grad_width) * (stage.dense + stage.experts) / copy_rate
        if cluster.fresh_page_s_per_byte:  # a host whose allocator pages FSDP's large buffers in every time
            fresh_gathers, fresh_reduces = fsdp_fresh_bytes(shape, dims, width, cluster.fresh_block_bytes, layers,
                                                            (block_gathers, root_gathers), grad_width)
            gather_copies += fresh_gathers * cluster.fresh_page_s_per_byte
            reduce_copies += fresh_reduces * cluster.fresh_page_s_per_byte
    copies_step = step_sync = last_backward = 0.0
    if dims.pp > 1:
        copies_mb, copies_step, step_sync = gather_copies, reduce_copies, reduce
    elif defer_all:  # one reduce-scatter a step, in the last micro-batch's backward
        copies_mb, copies_step, last_backward = gather_copies, reduce_copies, reduce
    else:
        per_mb, copies_mb = per_mb + reduce, gather_copies + reduce_copies
    if dims.dp_replicate > 1:  # HSDP: each unit's (a block's, its experts', the root's) reduced shard is all-reduced
        # over dp_replicate as its backward ends (FSDP2's foreach_reduce), one call per unit: in the last
        # micro-batch's backward, every micro-batch's under defer_grad_sync=none, after the last backward under pp
        rep_link = group_link(dims, ("dp_replicate",), cluster)

        def unit_all_reduce(dense: float, experts: float) -> float:
            return sum(all_reduce_time(rep_link, grad_width * n / link.size) for link, n in unit_calls(dense, experts))
        replicate = layers * unit_all_reduce(block_dense, block_experts) + unit_all_reduce(root, 0.0)
        if dims.pp > 1:
            step_sync += replicate
        elif p.defer_grad_sync == "none":
            per_mb += replicate
        else:
            last_backward += replicate
    return DataParallelTime(overlappable_mb=per_mb, last_backward=last_backward, copies_mb=copies_mb,
                            copies_step=copies_step, step_sync=step_sync,
                            owned=stage.dense / dims.dp_shard + stage.experts / dims.dp_shard_mod_ep)


def _ddp_time(config: Config, dims: ParallelDims, cluster: Cluster, stage: _Stage, micro_batches: int,
              hidden_by_backward: float, copy_rate: float) -> DataParallelTime:
    """torch DDP: one all-reduce of the whole gradients per step, bucket by bucket as the last micro-batch's backward
    produces them (every micro-batch's under defer_grad_sync=none: no no_sync); every rank updates everything. DDP
    cuts its buckets from the fp32 gradients; bf16 reduction compresses each (its comm hook)."""
    _, grad_width = _widths(config)
    syncs = micro_batches if config.parallel.defer_grad_sync == "none" else 1
    owned = stage.dense + stage.experts
    dp_link = group_link(dims, ("dp_replicate", "dp_shard_mod_ep", "ep"), cluster)
    buckets = [(dp_link, [b * grad_width / 4 for b in ddp_bucket_bytes(4 * owned)])]
    step_sync = syncs * max(0.0, _per_bucket(all_reduce_time, buckets) - hidden_by_backward)
    # the comm hook casts each fp32 bucket to bf16 and the sum back (read 4 + write 2, twice)
    copies_step = syncs * 12 * owned / copy_rate if grad_width != 4 else 0.0
    return DataParallelTime(copies_step=copies_step, step_sync=step_sync, owned=owned)


def _zero_time(config: Config, dims: ParallelDims, shape: ModelShape, cluster: Cluster, stage: _Stage,
               micro_batches: int, hidden_by_backward: float, copy_rate: float, sum_rate: float) -> DataParallelTime:
    """zero1/zero2 (optim/sharded.py): reduce-scatter the gradients (packed in the reduce dtype), all-gather the
    updated parameters (compute dtype) after the update, one collective per bucket each way, each paying its ring's
    latency; zero2 reduce-scatters each bucket in every micro-batch's backward as it is produced, so that backward
    hides it."""
    p = config.parallel
    width, grad_width = _widths(config)
    dp_link = group_link(dims, ("dp_replicate", "dp_shard_mod_ep", "ep"), cluster)
    expert_dp_link = group_link(dims, ("dp_replicate", "dp_shard_mod_ep"), cluster)
    dense_link = dp_link if p.ep_aware else expert_dp_link
    dense_buckets, expert_buckets = zero_bucket_sizes(shape, dims, stage.dense, stage.experts,
                                                      first=dims.pp == 1, last=True)
    buckets = [(dense_link, dense_buckets), (expert_dp_link, expert_buckets)]
    reduce = _per_bucket(lambda link, n: ring_time(link, grad_width * n, "reduce_scatter"), buckets)
    gather = _per_bucket(lambda link, n: ring_time(link, width * n), buckets)
    # and their buffers, which no link hides (optim/sharded.py, optim/buffers.py): _zero_copy_bytes
    group = dims.dp if p.ep_aware else dims.expert_dp
    zero2 = p.shard_mode == "zero2"
    first = later = unpack = sums = 0.0
    if dims.is_parallel:  # one process: a plain optimizer
        for elements, ranks in ((stage.dense, group), (stage.experts, dims.expert_dp)):
            copies = _zero_copy_bytes(elements, ranks, width, grad_width)
            first, later, unpack = first + copies[0], later + copies[1], unpack + copies[2]
            sums += _zero_sum_bytes(elements, ranks, grad_width)
    step_sync = (0.0 if zero2 else reduce) + gather
    if not p.ep_aware and dims.ep > 1:  # the EP-unaware baseline sums its reduced non-expert shard over ep too
        step_sync += all_reduce_time(group_link(dims, ("ep",), cluster), 4 * stage.dense / dims.expert_dp)
    owned = stage.dense / group + stage.experts / dims.expert_dp
    if zero2:  # it reduces in every micro-batch's backward: the step's first into nothing, the later ones summed
        copies_mb = (first + (micro_batches - 1) * later) / micro_batches / copy_rate + \
            (micro_batches - 1) * sums / micro_batches / sum_rate
        return DataParallelTime(exposed_mb=max(0.0, reduce - hidden_by_backward), copies_mb=copies_mb,
                                copies_step=unpack / copy_rate, step_sync=step_sync, owned=owned)
    return DataParallelTime(copies_step=(first + unpack) / copy_rate, step_sync=step_sync, owned=owned)


def _zero_copy_bytes(elements: float, ranks: int, width: int, grad_width: int) -> tuple[float, float, float]:
    """Bytes zero1/zero2's buffers copy for `elements` parameters sharded over `ranks` (optim/sharded.py): (the
    step's first reduction, a later one (zero2's later micro-batches), the step's parameter gather).
    Over several ranks a reduction packs the whole gradients into the bucket buffer (read `width`, write the reduce
    dtype's) and lands the reduced shard: written there by the collective itself (the first, in fp32) or copied into
    the fp32 shard (the first, in bf16); a later one's is added to it (_zero_sum_bytes); after the update each rank
    writes its masters into the send area (4 + width B per owned element) and the gathered blocks are copied into
    the parameters (read and write `width`). On one rank nothing travels: the first reduction packs straight into
    the fp32 shard, a later one into the buffer (in fp32) before it is added, and the update writes the masters into
    the parameters, unless fp32 parameters are their own masters."""
    if ranks == 1:
        return (width + 4) * elements, (width + 4) * elements, (0 if width == 4 else 4 + width) * elements
    pack = width + grad_width
    first = pack + (0 if grad_width == 4 else grad_width + 4) / ranks
    return first * elements, pack * elements, (2 * width + (4 + width) / ranks) * elements


def _zero_sum_bytes(elements: float, ranks: int, grad_width: int) -> float:
    """Bytes a later zero2 reduction's sum into the fp32 shard moves for `elements` parameters sharded over `ranks`
    (optim/sharded.py's grad_shard.add_: read the shard and the landed output, write the shard): an in-place
    elementwise sum like autograd's gradient accumulation, priced at its rate, not a copy's (on the 2-core EPYC an
    fp32 add_ moved 1.7x a packing copy's bytes a second). One rank's sum is of fp32 buffers."""
    return 12 * elements if ranks == 1 else (4 + grad_width + 4) * elements / ranks


def _widths(config: Config) -> tuple[int, int]:
    """Bytes an element of (the compute dtype, the gradient reduction's dtype: parallel.grad_reduce_dtype)."""
    return (4 if config.train.dtype == "fp32" else 2), config.parallel.grad_reduce_bytes
