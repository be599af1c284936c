"""Per-rank memory of any layout, by arithmetic: the dry run's accounting without building the model per layout.

The dry run (optimus/parallel/dry_run.py) applies a layout for real on the meta device; a search over
thousands of layouts cannot afford that, so this module counts the same terms from one meta build of
the unsplit model (ModelShape) and the layout's degrees:

    fsdp          fp32 parameters, gradients and AdamW moments (16 B / element) of this rank's shard: non-expert
                  weights split over tp (matrices only) then dp_shard, experts over ep x tp then dp_shard_mod_ep;
                  plus the FSDP transient (two gathered blocks, one block's unreduced gradients, the root unit;
                  under pp the whole stage's weights and fp32 gradients: dry_run.fsdp_transient_bytes);
                  FSDP2 cuts each tensor along one dim into ceil-sized shards: the largest shard is held, and an
                  all-gather produces every rank's padded shard (fsdp_elements: a [64, ...] expert tensor over
                  3,072 ranks gathers 3,072 rows)
    zero1/zero2   whole parameters in the compute dtype, an fp32 gradient shard, fp32 master (under bf16) and
                  moments for the owned share: non-expert over dp (EP-aware) or expert_dp, experts over expert_dp;
                  zero1 also holds the whole gradients until the step, zero2 only about two buckets in flight
    ddp           whole fp32 parameters, gradients, moments, and DDP's fp32 gradient buckets
    activations   activation_memory.rank_activation_bytes (the same formula): what each micro-batch the schedule keeps in
                  flight saves, plus once the block being recomputed and the LM head's weight gradient
    overlap       with one micro-batch a step, the gradients the backward creates (fp32 per parameter held, zero1's
                  whole ones) and the activations it frees are not both at the peak: the smaller comes off
                  (dry_run.gradients_not_at_the_activation_peak); FSDP under pp: the sharded gradients are made
                  only by the step's one reduce-scatter, which holds a flat copy of the unsharded ones instead of
                  the activations: the larger of the two counts (dry_run.fsdp_deferred_reduce_bytes; summing in a
                  dtype other than the backward's, its cast temporaries: fsdp_accumulate_cast_bytes); FSDP without
                  pp: the root's reduce at the end of the backward holds every sharded gradient and the root's flat
                  copy (on CPU: gloo's copy of it and the loss's head-weight gradient; summing micro-batches, the
                  reduce's output shard beside the gradients it is added to) but no activations and no transient:
                  the larger phase counts (dry_run.fsdp_root_reduce_bytes); under HSDP with several
                  micro-batches it also meets the last backward's reduced shards, which FSDP2 keeps until that
                  backward ends (dry_run.hsdp_last_shards_bytes); under defer_grad_sync=all the later
                  micro-batches' activations meet every unit's whole accumulated gradients, not the shards
                  (dry_run.fsdp_accumulated_beyond_shards_bytes). dry_run.peak_phase_terms composes these, for the
                  dry run alike

Both the first pipeline stage (embedding, most micro-batches in flight) and the last (LM head and the loss's
saved gradients) are counted; the larger is the rank's peak. tests/unit/plan checks it against the dry run.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from optimus.config import Config
from optimus.parallel.activation_memory import (
    autocast_weight_copy_bytes,
    micro_batches_in_flight,
    rank_activation_bytes,
)
from optimus.parallel.dry_run import (
    ACCUMULATED_LABEL,
    OVERLAP_LABEL,
    fsdp_transient_bytes,
    peak_phase_terms,
    zero_gradient_bytes,
)
from optimus.parallel.mesh import ParallelDims
from optimus.parallel.validate import resolve_batch


# How tensor parallelism splits each weight (parallel/tensor_parallel.py's plan): column-parallel weights, the
# vocabulary-parallel embedding and head, and QK-norm's sharded weight along dim 0; row-parallel ones along dim 1
_TP_DIM0 = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.", ".q_norm.", ".k_norm.", "embed.", "lm_head.")
_TP_DIM1 = (".o_proj.", ".down_proj.")


@dataclass(frozen=True)
class TensorShape:
    """One weight of the unsplit model, as FSDP's sharding sees it after tp and ep have split it."""

    shape: tuple[int, ...]
    tp_dim: int | None  # the dim tensor parallelism splits (experts: dim 0, over ep x tp)
    expert: bool
    where: str  # "block" (one block's), "embedding" or "head" (root, with the final norm)

    def local_shape(self, dims: ParallelDims) -> list[int]:
        """Its shape on one rank once tp (and ep, for experts) have split it (ceil-sized, as DTensor splits)."""
        shape = list(self.shape)
        if self.tp_dim is not None and shape:
            shape[self.tp_dim] = -(-shape[self.tp_dim] // (dims.tp * (dims.ep if self.expert else 1)))
        return shape

    def on_stage(self, first: bool, last: bool) -> bool:
        """Whether a pipeline stage holds it: every stage its blocks', the first the embedding, the last the head."""
        return self.where == "block" or (self.where == "embedding" and first) or (self.where == "head" and last)


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts of the unsplit model, grouped by how a layout splits them."""

    n_layers: int
    block_tp_split: int  # per block: attention / dense-MLP matrices (split over tp)
    block_replicated: int  # per block: norms and router (whole on every tp rank)
    block_attention: int  # per block: the attention matrices (part of block_tp_split; for the FLOP split)
    block_experts: int  # per block: expert weights (split over ep x tp)
    embedding: int
    head: int  # LM head (split over tp along the vocabulary) and final norm (whole, negligible)
    tensors: tuple[TensorShape, ...]  # one block's weights and the root's, for FSDP's per-tensor padding

    @classmethod
    def of(cls, config: Config) -> "ModelShape":
        """Count from a meta build (no memory is allocated)."""
        from optimus.models.transformer import build_model

        model = build_model(config.model, device="meta")
        split = replicated = experts = embedding = head = attention = 0
        tensors = []
        for name, param in model.named_parameters():
            n = param.numel()
            expert = ".experts." in name
            where = "embedding" if name.startswith("embed.") else "block" if name.startswith("layers.") else "head"
            if where != "block" or name.startswith("layers.0."):
                tp_dim = 0 if expert or any(k in name for k in _TP_DIM0) else 1 if any(k in name for k in _TP_DIM1) \
                    else None
                tensors.append(TensorShape(tuple(param.shape), tp_dim, expert, where))
            if name.startswith("embed."):
                embedding += n
            elif not name.startswith("layers."):
                head += n
            elif expert:
                experts += n
            elif param.ndim >= 2 and ".router." not in name:
                split += n
                attention += n if ".attn." in name else 0
            else:
                replicated += n
        layers = config.model.n_layers
        return cls(layers, split // layers, replicated // layers, attention // layers, experts // layers, embedding,
                   head, tuple(tensors))

    @property
    def total(self) -> int:
        """All parameters."""
        return self.n_layers * (self.block_tp_split + self.block_replicated + self.block_experts) + self.embedding + self.head


def fsdp_elements(tensor: TensorShape, dims: ParallelDims) -> tuple[int, int]:
    """(the largest rank's shard, the all-gather's output) in elements of one weight under FSDP2: split over tp (and
    ep for experts), then cut along dim 0 into ceil-sized shards over dp_shard (experts: dp_shard_mod_ep, along
    dim 1 when their experts do not divide but dim 1 does: data_parallel._expert_shard_dim)."""
    shape = tensor.local_shape(dims)
    ranks = dims.dp_shard_mod_ep if tensor.expert else dims.dp_shard
    if not shape:
        return 1, ranks
    dim = 1 if tensor.expert and len(shape) > 1 and shape[0] % ranks and shape[1] % ranks == 0 else 0
    rest = math.prod(shape) // max(shape[dim], 1)
    shard = -(-shape[dim] // ranks) * rest
    return shard, shard * ranks


def fsdp_gathered_block(shape: ModelShape, dims: ParallelDims) -> tuple[float, float]:
    """(non-expert, expert) elements one block's FSDP all-gathers produce (and its reduce-scatters consume), padding
    included: what the collectives move."""
    dense = experts = 0
    for tensor in shape.tensors:
        if tensor.where == "block":
            gathered = fsdp_elements(tensor, dims)[1]
            dense, experts = (dense, experts + gathered) if tensor.expert else (dense + gathered, experts)
    return dense, experts


def fsdp_stage_elements(shape: ModelShape, dims: ParallelDims, layers: int, first: bool, last: bool
                        ) -> tuple[int, int, int]:
    """(the largest rank's shard of a stage, one block gathered, the stage's root gathered) in elements, FSDP2's
    padding included."""
    local = block = root = 0
    for tensor in shape.tensors:
        held, gathered = fsdp_elements(tensor, dims)
        if tensor.where == "block":
            local, block = local + layers * held, block + gathered
        elif tensor.on_stage(first, last):
            local, root = local + held, root + gathered
    return local, block, root


@functools.lru_cache(maxsize=4096)  # a search prices each mesh for every micro-batch, recompute and schedule
def _fsdp_stage(shape: ModelShape, dims: ParallelDims, layers: int, first: bool, last: bool
                ) -> tuple[int, int, int, int]:
    """fsdp_stage_elements, and the stage's largest tensor gathered (elements)."""
    largest = max((fsdp_elements(t, dims)[1] for t in shape.tensors if t.on_stage(first, last)), default=0)
    return (*fsdp_stage_elements(shape, dims, layers, first, last), largest)


def _ceil_div(a: float, b: int) -> float:
    return -(-int(a) // b)


def stage_memory(config: Config, dims: ParallelDims, shape: ModelShape, stage: int,
                 loss_on_cpu: bool = False, routing_imbalance: float = 1.0) -> dict[str, float]:
    """Bytes one rank of pipeline stage `stage` holds, by term (config: validated, micro-batch resolved);
    `loss_on_cpu`: the devices are CPUs, whose loss head holds other buffers (activation_memory.loss_head_bytes);
    `routing_imbalance`: the busiest rank's routed rows over its balanced share (activation_split)."""
    width = 2 if config.train.dtype in ("bf16", "auto") else 4
    layers = _ceil_div(shape.n_layers, dims.pp)
    first, last = stage == 0, stage == dims.pp - 1
    # the embedding and the LM head are split over tp along the vocabulary (parallel/vocab_parallel.py)
    root_dense = (shape.embedding / dims.tp if first else 0) + (shape.head / dims.tp if last else 0)
    dense = layers * (shape.block_tp_split / dims.tp + shape.block_replicated) + root_dense
    experts = layers * shape.block_experts / (dims.ep * dims.tp)
    blocks, gathered_root, largest = [], 0.0, 0  # FSDP's units and largest tensor, gathered (none without FSDP)
    if config.parallel.shard_mode == "fsdp":
        local, gathered_block, gathered_root, largest = _fsdp_stage(shape, dims, layers, first, last)
        blocks = [gathered_block] * layers
        transient = fsdp_transient_bytes(blocks, gathered_root, width, dims, config.parallel.grad_reduce_bytes)
        held = {"parameters": 4 * local, "gradients": 4 * local, "optimizer": 8 * local, "FSDP transient": transient}
    elif config.parallel.shard_mode == "ddp":  # whole fp32 replicas and DDP's fp32 gradient buckets
        local = dense + experts
        held = {"parameters": 4 * local, "gradients": 4 * local, "optimizer": 8 * local, "DDP buckets": 4 * local}
    else:
        expert_dp = dims.dp_replicate * dims.dp_shard_mod_ep
        owned = dense / (dims.dp if config.parallel.ep_aware else expert_dp) + experts / expert_dp
        local = dense + experts
        master = 4 * owned if width == 2 else 0.0
        held = {"parameters": width * local,
                "gradients": zero_gradient_bytes(config.parallel.shard_mode, local, owned, width,
                                                 _zero_buffer_bytes(config, dims, shape, dense, experts, first, last,
                                                                    width)),
                "optimizer": master + 8 * owned}
    act_config = config
    if config.train.dtype == "auto":  # as the dry run: accelerators compute bf16 natively
        act_config = config.model_copy(update={"train": config.train.model_copy(update={"dtype": "bf16"})})
    in_flight = micro_batches_in_flight(act_config, dims, stage)
    held["activations"] = rank_activation_bytes(act_config, dims, layers, last, in_flight, loss_on_cpu,
                                                routing_imbalance)
    held["bf16 weight copies (autocast)"] = autocast_weight_copy_bytes(act_config, dims, layers, last, loss_on_cpu)
    loss_weight_gradient = 4.0 * config.model.vocab_size * config.model.d_model / dims.tp if loss_on_cpu else 0.0
    micro_batches = resolve_batch(config.train, dims, config.parallel.pp_schedule).micro_batches
    accumulated, overlap = peak_phase_terms(config, dims, micro_batches, config.parallel.shard_mode, local, width,
                                            held["activations"], held.get("FSDP transient"), blocks, gathered_root,
                                            largest, loss_weight_gradient, gloo=loss_on_cpu)
    if accumulated:
        held[ACCUMULATED_LABEL] = accumulated
    held[OVERLAP_LABEL] = -overlap
    return held


def _zero_buffer_bytes(config: Config, dims: ParallelDims, shape: ModelShape, dense: float, experts: float,
                       first: bool, last: bool, width: int) -> float:
    """The zero modes' two persistent bucket buffers, sized by the optimizer's own rule (optim/buffers.py
    buffer_nbytes) for this stage's buckets (zero_bucket_sizes): the non-expert parameters over their group, then
    the experts over expert_dp; each bucket cut into equal segments (optim/flat.py)."""
    p = config.parallel
    return _zero_buffers(p.shard_mode == "zero2", p.ep_aware, p.grad_reduce_bytes, dims, shape, dense, experts,
                         first, last, width)


@functools.lru_cache(maxsize=4096)  # a search prices each mesh for every micro-batch, recompute and schedule
def _zero_buffers(zero2: bool, ep_aware: bool, reduce_bytes: int, dims: ParallelDims, shape: ModelShape,
                  dense: float, experts: float, first: bool, last: bool, width: int) -> float:
    from optimus.optim.buffers import buffer_nbytes

    if not dims.is_parallel:
        return 0.0
    expert_dp = dims.dp_replicate * dims.dp_shard_mod_ep
    dense_ranks = dims.dp if ep_aware or dims.ep == 1 else expert_dp
    dense_buckets, expert_buckets = zero_bucket_sizes(shape, dims, dense, experts, first, last)
    layout = [(ranks, math.ceil(size / ranks))
              for buckets, ranks in ((dense_buckets, dense_ranks), (expert_buckets, expert_dp)) for size in buckets]
    return float(sum(buffer_nbytes(layout, width, zero2, reduce_bytes)))


def zero_bucket_sizes(shape: ModelShape, dims: ParallelDims, dense: float, experts: float, first: bool,
                      last: bool) -> tuple[list[int], list[int]]:
    """The zero modes' buckets of a stage in elements (optim/sharded.py), the non-expert parameters' and the
    experts': each group of `dense` / `experts` local elements in buckets of DEFAULT_BUCKET_NUMEL, a larger
    parameter (the embedding, the LM head, a large matrix: the stage's weights as tp and ep leave them) in a
    bucket of its own. Each bucket is one reduce-scatter and one all-gather."""
    from optimus.optim.sharded import DEFAULT_BUCKET_NUMEL

    numels = [(tensor.expert, math.prod(tensor.local_shape(dims))) for tensor in shape.tensors
              if tensor.on_stage(first, last)]
    large_dense = [numel for expert, numel in numels if not expert]
    large_expert = [numel for expert, numel in numels if expert]
    return (_bucket_sizes(dense, large_dense, DEFAULT_BUCKET_NUMEL),
            _bucket_sizes(experts, large_expert, DEFAULT_BUCKET_NUMEL))


def _bucket_sizes(numel: float, large: list[float], bucket: int) -> list[int]:
    """A group of `numel` elements in buckets, the largest first: up to two parameters above `bucket` alone (the
    two buffers' sizes are set by the two largest buckets), the rest in buckets of `bucket`, the last short."""
    sizes = [int(p) for p in sorted(large, reverse=True)[:2] if p > bucket]
    rest = max(0, int(numel) - sum(sizes))
    full, tail = divmod(rest, bucket)
    return sizes + [bucket] * full + ([tail] if tail else [])


def peak_memory(config: Config, dims: ParallelDims, shape: ModelShape, loss_on_cpu: bool = False,
                routing_imbalance: float | dict[int, float] = 1.0) -> float:
    """The largest per-rank total over the first and last pipeline stage, in bytes; `routing_imbalance`: one figure
    for every stage, or one per stage (plan/routing.py: a run's logged routing, each stage's layers)."""
    return sum(peak_stage_memory(config, dims, shape, loss_on_cpu, routing_imbalance).values())


def peak_stage_memory(config: Config, dims: ParallelDims, shape: ModelShape, loss_on_cpu: bool = False,
                      routing_imbalance: float | dict[int, float] = 1.0) -> dict[str, float]:
    """stage_memory's terms of the stage (first or last) whose total is peak_memory."""
    stages = sorted({0, dims.pp - 1})
    imbalance = routing_imbalance if isinstance(routing_imbalance, dict) else dict.fromkeys(stages, routing_imbalance)
    return max((stage_memory(config, dims, shape, s, loss_on_cpu, imbalance[s]) for s in stages),
               key=lambda terms: sum(terms.values()))
