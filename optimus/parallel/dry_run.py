"""Dry run at scale: the real parallel model of one rank, on the meta device, in one CPU process.

A fake process group (world size N, this process playing one rank) lets DeviceMesh, FSDP2,
DTensor TP, expert and pipeline parallelism be applied for real, so every parameter has the
shape and placement it would have on that rank of the N-rank job. No memory is allocated. From
those shapes we print what the rank holds:

    parameters        fp32 master weights, this rank's shards            4 B / element
    gradients         fp32, sharded like the parameters (reduce-scattered in parallel.grad_reduce_dtype)   4 B
    optimizer state   AdamW exp_avg + exp_avg_sq, fp32                   8 B / element
    FSDP transient    weights gathered for two blocks (the running one + the prefetched one); under pp the
                      whole stage's weights and gradients in the reduce dtype (torch's stages defer resharding
                      and reduction, and FSDP accumulates in the dtype it reduces in)
                      and one block's unreduced gradients, plus the root unit (embedding, final
                      norm, LM head), which stays gathered for the whole step
    activations       activation_memory.activation_split(): what each micro-batch keeps, times the micro-batches
                      a pipeline schedule keeps in flight, plus once what only the micro-batch in
                      its backward needs (the recomputed block, the loss head's logits buffers and
                      gradients, as the device runs it: loss_head_bytes())
    overlap           what the peak does not hold of the sum: with one micro-batch a step the smaller of the
                      gradients and the activations; FSDP under pp the sharded gradients, whose one deferred
                      reduce-scatter holds a copy of the unsharded ones while no activations are left
                      (gradients_not_at_the_activation_peak)

The activation figure is an estimate (the formulas are in activation_memory.py, within 5% of what autograd
really keeps for these blocks); allocator fragmentation and communication buffers come on top,
which is why the verdict wants 10% headroom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from optimus.config import Config
from optimus.parallel.activation_memory import (
    step_batch,
    activation_bytes,
    activation_split,
    autocast_weight_copy_bytes,
    checkpointing_modes,
    forwards_first,
    loss_head_bytes,
    micro_batches_in_flight,
    rank_activation_bytes,
)
from optimus.parallel.mesh import ParallelDims
from optimus.parallel.validate import BatchLayout, validate_layout

GIB = 1024**3
HEADROOM = 0.9  # fraction of device memory a plan may use
_MODEL_PARALLEL_DIMS = ("tp", "ep")  # mesh dims that split a weight for good (FSDP's are gathered)


@dataclass
class RankMemory:
    """What one rank holds, in bytes (and its parameter count)."""

    rank: int
    stage: int
    layers: int
    parameters: int
    in_flight: float = 1  # micro-batches whose activations are held at once (interleaved: a half counts)
    bytes: dict[str, float] = field(default_factory=dict)  # what the rank holds: summed into the total
    activations_per_micro_batch: dict[str, float] = field(default_factory=dict)  # by checkpointing mode

    @property
    def total(self) -> float:
        return sum(self.bytes.values())


@dataclass
class DryRunReport:
    config: Config
    dims: ParallelDims
    device_memory_gb: float
    ranks: list[RankMemory]
    total_parameters: int
    notes: list[str]
    batch: BatchLayout | None = None  # the step's split over ranks and micro-batches


def _local_numel(param: torch.Tensor) -> int:
    """Elements this rank allocates for `param`: shards are padded to the largest one (FSDP2 does)."""
    if not hasattr(param, "device_mesh"):
        return param.numel()
    shape = list(param.shape)
    for index, placement in enumerate(param.placements):
        dim = getattr(placement, "dim", None)  # Shard and _StridedShard (FSDP over TP/EP) both split `dim`
        if dim is not None:
            shape[dim] = -(-shape[dim] // param.device_mesh.size(index))
    return math.prod(shape)


def _gathered_numel(param: torch.Tensor) -> int:
    """Elements FSDP's all-gather of `param` produces: still split over tp and ep, and along its FSDP-sharded dim
    rounded up to whole shards (FSDP2 gathers every rank's padded shard: a [64, ...] tensor over 3,072 ranks
    gathers 3,072 rows)."""
    if not hasattr(param, "device_mesh"):
        return param.numel()
    shape = list(param.shape)
    names = param.device_mesh.mesh_dim_names or ()
    placed = [(index, getattr(placement, "dim", None)) for index, placement in enumerate(param.placements)]
    model_parallel = [(i, d) for i, d in placed if d is not None and i < len(names) and names[i] in _MODEL_PARALLEL_DIMS]
    for index, dim in model_parallel:
        shape[dim] = -(-shape[dim] // param.device_mesh.size(index))
    for index, dim in placed:
        if dim is not None and (index, dim) not in model_parallel:
            ranks = param.device_mesh.size(index)
            shape[dim] = -(-shape[dim] // ranks) * ranks
    return math.prod(shape)


def fsdp_transient_bytes(blocks: list[float], root: float, width: int, dims: ParallelDims,
                         reduce: float = 4.0) -> float:
    """Bytes FSDP holds gathered beyond the shards: two blocks' weights (the running and the prefetched one), one
    block's unreduced gradients and the root unit; under pp the whole stage's weights and gradients, since torch's
    pipeline stages keep blocks gathered after their backward and accumulate unsharded gradients until the step's
    one reduce-scatter (pipelining/stage.py: reshard_after_backward and requires_gradient_sync off between
    micro-batches). A block's gradients count at the wider of the compute width (as backward writes them) and
    `reduce`, the width FSDP reduces them in (its reduce-scatter input); accumulated under pp, at `reduce` (FSDP
    accumulates in the dtype it reduces in). Without data parallelism (one process, tp / pp only) there is no
    FSDP: nothing is gathered."""
    if not dims.has_data_parallel:
        return 0.0
    if dims.pp > 1:
        return (sum(blocks) + root) * (width + reduce)
    largest = max(blocks, default=0)
    return (2 * largest + root) * width + max(width, reduce) * largest


def _measure_rank(model: nn.Module, config: Config, dims: ParallelDims, rank: int) -> RankMemory:
    params = list(model.parameters())
    local = sum(_local_numel(p) for p in params)
    layers = len(model.layers)
    stage = rank // (dims.world_size // dims.pp)  # the model is this stage's part: parallelize_model split it
    has_head = getattr(model, "lm_head", None) is not None
    width = 2 if config.train.dtype == "bf16" else 4
    reduce = config.parallel.grad_reduce_bytes
    blocks = [sum(_gathered_numel(p) for p in block.parameters()) for block in model.layers.values()]
    block_ids = {id(p) for p in model.layers.parameters()}
    root = sum(_gathered_numel(p) for p in params if id(p) not in block_ids)
    in_flight = micro_batches_in_flight(config, dims, stage)
    memory = RankMemory(rank=rank, stage=stage, layers=layers, parameters=local, in_flight=in_flight)
    memory.bytes = {
        "parameters (fp32)": 4.0 * local,
        "gradients (fp32)": 4.0 * local,
        "optimizer (AdamW, 2 x fp32)": 8.0 * local,
        # no data parallelism, no FSDP: nothing is gathered
        "FSDP transient": fsdp_transient_bytes(blocks, root, width, dims, reduce),
        **({"DDP gradient buckets (fp32)": 4.0 * local} if config.parallel.shard_mode == "ddp" else {}),
        "activations (as configured)": rank_activation_bytes(config, dims, layers, has_head, in_flight),
    }
    copies = autocast_weight_copy_bytes(config, dims, layers, has_head)
    if copies:  # fp32 weights computed in bf16: one process, tp or pp alone, ddp
        memory.bytes["bf16 weight copies (autocast)"] = copies
    if getattr(model, "zero_plan", None) is not None:
        memory.bytes = {**_zero_bytes(model, config, dims), **{
            k: v for k, v in memory.bytes.items() if k.startswith("activations")}}
    if config.parallel.shard_mode == "ddp":  # whole replicas, nothing gathered
        memory.bytes.pop("FSDP transient")
    mode = config.parallel.shard_mode if getattr(model, "zero_plan", None) is not None else "fsdp"
    largest = max((_gathered_numel(p) for p in params), default=0)
    accumulated, overlap = peak_phase_terms(config, dims, step_batch(config, dims).micro_batches, mode, local, width,
                                            memory.bytes["activations (as configured)"],
                                            memory.bytes.get("FSDP transient"), blocks, root, largest)
    if accumulated:
        memory.bytes[ACCUMULATED_LABEL] = accumulated
    if overlap:
        memory.bytes[OVERLAP_LABEL] = -overlap
    for label, variant in checkpointing_modes(config).items():
        memory.activations_per_micro_batch[label] = activation_bytes(variant, dims, layers, has_head)
    return memory


OVERLAP_LABEL = "overlap: gradients / activations"
ACCUMULATED_LABEL = "FSDP whole gradients beyond the shards (defer_grad_sync=all)"


def peak_phase_terms(config: Config, dims: ParallelDims, micro_batches: int, mode: str, local: float, width: int,
                     activations: float, transient: float | None, blocks: list[float], root: float, largest: float,
                     loss_weight_gradient: float = 0.0, gloo: bool = False) -> tuple[float, float]:
    """The two terms that place a rank's peak in the phase that holds the most (the dry run and plan/memory count
    them alike): (FSDP's whole gradients beyond the shards under defer_grad_sync=all, the bytes to take off the
    sum of the other terms: gradients_not_at_the_activation_peak). `local`: the elements this rank holds;
    `transient`: FSDP's (None where FSDP is not applied); `blocks`, `root`, `largest`: the stage's blocks, its
    root unit and its largest tensor in gathered elements; `loss_weight_gradient` and `gloo` as
    fsdp_root_reduce_bytes takes them."""
    reduce = config.parallel.grad_reduce_bytes
    deferred = root_reduce = accumulated = 0.0
    if transient is not None:
        deferred = max(fsdp_deferred_reduce_bytes(blocks, root, dims, reduce),
                       fsdp_accumulate_cast_bytes(blocks, root, largest, width, dims, reduce))
        root_reduce = (fsdp_root_reduce_bytes(root, dims, loss_weight_gradient, gloo=gloo, reduce=reduce,
                                              accumulating=fsdp_reduce_accumulates(config, dims, micro_batches)) +
                       hsdp_last_shards_bytes(config, dims, micro_batches, local))
        accumulated = fsdp_accumulated_beyond_shards_bytes(config, dims, micro_batches, blocks, root, local)
    overlap = gradients_not_at_the_activation_peak(micro_batches, whole_gradient_bytes(mode, local, width),
                                                   activations + accumulated, deferred, root_reduce, transient or 0.0,
                                                   forwards_first(config, dims),
                                                   keeps_gradients_between_backwards(mode))
    return accumulated, overlap


def whole_gradient_bytes(mode: str, local: float, width: int) -> float:
    """The gradients a step creates in its backward and frees by the next one's forward: fp32 per parameter held
    (one process, FSDP's shards, DDP), the compute-dtype whole gradients of zero1, zero2's filling buckets."""
    from optimus.optim.sharded import DEFAULT_BUCKET_NUMEL

    if mode == "zero1":
        return width * local
    if mode == "zero2":
        return width * min(local, 2 * DEFAULT_BUCKET_NUMEL)
    return 4.0 * local


def keeps_gradients_between_backwards(mode: str) -> bool:
    """Whether the whole gradients whole_gradient_bytes counts outlive the backward that made them: not zero2's,
    whose buckets are reduced and dropped in every backward (optim/sharded.py)."""
    return mode != "zero2"


def gradients_not_at_the_activation_peak(micro_batches: int, gradients: float, activations: float,
                                         deferred_reduce: float = 0.0, root_reduce: float = 0.0,
                                         transient: float = 0.0, forwards_first: bool = False,
                                         kept_between_backwards: bool = True) -> float:
    """Bytes to take off a sum that holds both a step's gradients and its activations. The trainer frees the
    gradients before each step (zero_grad(set_to_none)) and the backward creates them while it frees the
    activations, so with one micro-batch a step the peak holds the larger of the two, not both (one process on
    the tiny dense model: 712 MiB allocated at the peak, 821 predicted counting both). With several micro-batches
    the later ones' activations meet the gradients accumulated so far: nothing comes off, unless the schedule runs
    every forward before the first backward (`forwards_first`: GPipe), whose peak then meets no gradient either,
    or the gradients counted do not outlive their backward (not `kept_between_backwards`: zero2 reduces its buckets
    and drops the whole gradients in every backward, summing only its fp32 shard, counted apart; dense zero2 at 2
    ranks summing two micro-batches read 586 MiB, 701 predicted with them at the later activation peak).
    deferred_reduce: FSDP under pp (fsdp_deferred_reduce_bytes). The stage reduces once, after its last backward,
    so the sharded gradients exist only then, when the activations are gone and the reduce-scatters hold flat
    copies of the unsharded gradients: the peak holds the larger of the activations and those copies (or what
    summing them in another dtype holds: fsdp_accumulate_cast_bytes), never the sharded gradients (the tiny MoE
    at FSDP 2 x EP 2 x PP 2, allocator's peak: the last stage's inside the loss, the first stage's in its
    reduce-scatter).
    root_reduce: FSDP without pp (fsdp_root_reduce_bytes). Its last reduce, the root's at the end of the backward,
    meets every sharded gradient but no activations and no FSDP `transient` (the blocks and the root are
    resharded by then): the peak is the larger of that phase and the one above, so this may take off less than
    nothing (the tiny MoE at FSDP 2 x EP 2 with selective checkpointing, allocator's peak: in the root's
    reduce-scatter once the CPU loss kept one [512, V] buffer)."""
    if deferred_reduce:
        return gradients + activations - max(activations, deferred_reduce)
    apart = micro_batches == 1 or forwards_first or not kept_between_backwards
    held = max(gradients, activations) if apart else gradients + activations
    if root_reduce:
        held = max(transient + held, gradients + root_reduce) - transient
    return gradients + activations - held


def fsdp_root_reduce_bytes(root: float, dims: ParallelDims, loss_weight_gradient: float = 0.0,
                           gloo: bool = False, reduce: float = 4.0, accumulating: bool = False) -> float:
    """What FSDP holds beyond the sharded gradients while it reduces the root unit (embedding, final norm, LM
    head; `root` in unsharded elements) at the end of the backward, without pp: the flat reduce-scatter input of
    the root's gradients (`reduce` bytes an element: fp32 4, bf16 2), with `gloo` (CPU) also the copy gloo's
    reduce_scatter makes of its input (none where dp_shard is 1: FSDP2 copies the input to its output instead, whose
    size the sharded gradients already count, and runs no reduce-scatter),
    `loss_weight_gradient`: what the loss keeps until the backward ends (the CPU's fused loss ops hold their fp32
    head-weight gradient in their autograd node), and where the reduce output is added to the gradients earlier
    micro-batches left (`accumulating`: fsdp_reduce_accumulates) that output, one root shard, beside them. 0 under
    pp (fsdp_deferred_reduce_bytes) or without data parallelism."""
    if dims.pp > 1 or not dims.has_data_parallel:
        return 0.0
    output = reduce * root / dims.dp_shard if accumulating else 0.0
    return reduce * root * (2 if gloo and dims.dp_shard > 1 else 1) + loss_weight_gradient + output


def fsdp_reduce_accumulates(config: Config, dims: ParallelDims, micro_batches: int) -> bool:
    """Whether FSDP (over dp_shard alone, no pp) reduces a later micro-batch's gradients into a fresh output and
    adds it to the sharded gradients the earlier ones left (torch's foreach_reduce, to_accumulate_grad), so the
    root's reduce holds one more root shard than the gradients count. Measured, the tiny dense at FSDP 2 x TP 2
    with two micro-batches: 262 MiB allocated at the peak on every rank, in the root's reduce-scatter, 237 predicted
    without that shard (24.6 MiB). Not under HSDP (hsdp_last_shards_bytes counts every unit's fresh shard), nor
    under defer_grad_sync=all (one reduce a step, into no gradients)."""
    return (config.parallel.shard_mode == "fsdp" and dims.pp == 1 and dims.dp_replicate == 1 and dims.dp_shard > 1
            and micro_batches > 1 and config.parallel.defer_grad_sync != "all")


def hsdp_last_shards_bytes(config: Config, dims: ParallelDims, micro_batches: int, local: float) -> float:
    """What HSDP (FSDP over dp_replicate x dp_shard, no pp) holds beside the sharded gradients at the end of a step's
    last backward when it sums several micro-batches: FSDP2 keeps each unit's freshly reduced shard (its all-reduce
    buffer, in the reduce dtype: FSDPParamGroup._all_reduce_state, or _partial_reduce_output) until that backward
    ends, apart from the gradients the earlier micro-batches left; so the root's reduce meets one more shard of
    every unit (`local` elements). Measured, the tiny MoE at HSDP 2 x 2 with two micro-batches of one sequence:
    766 MiB allocated at the peak, 791 syncing every micro-batch, against 667 with one micro-batch of two. None
    under defer_grad_sync=all: the last backward's shards become the gradients."""
    if (config.parallel.shard_mode != "fsdp" or dims.pp > 1 or dims.dp_replicate == 1 or micro_batches == 1
            or config.parallel.defer_grad_sync == "all"):
        return 0.0
    return config.parallel.grad_reduce_bytes * local


def fsdp_accumulated_beyond_shards_bytes(config: Config, dims: ParallelDims, micro_batches: int, blocks: list[float],
                                         root: float, local: float) -> float:
    """Under defer_grad_sync=all without pp FSDP reduces nothing until the last micro-batch: it accumulates every
    unit's whole gradients, in its reduce dtype (`blocks` and `root` in gathered elements), and the later
    micro-batches' activation peak meets those instead of the fp32 shards (`local` elements, made only by the last
    backward's reduce): what that adds beyond the shards. 0 otherwise (under pp fsdp_transient_bytes counts them).
    Measured, the tiny dense at HSDP 2 x 2 with two micro-batches: 490 MiB allocated at the peak on every rank,
    474 predicted without it, 485 with it."""
    if (config.parallel.shard_mode != "fsdp" or dims.pp > 1 or not dims.has_data_parallel or micro_batches == 1
            or config.parallel.defer_grad_sync != "all"):
        return 0.0
    return max(0.0, config.parallel.grad_reduce_bytes * (sum(blocks) + root) - 4.0 * local)


def fsdp_accumulate_cast_bytes(blocks: list[float], root: float, largest: float, width: int, dims: ParallelDims,
                               reduce: float = 4.0) -> float:
    """Under pp FSDP sums a stage's unsharded gradients over its micro-batches in the dtype it reduces in
    (FSDPParam.unsharded_accumulated_grad); where the backward makes them in another (fp32 compute reducing in bf16,
    or the reverse), every later micro-batch's post-backward holds a unit's fresh gradients (`width` bytes) beside
    those sums, and the in-place add's fp32 temporaries of the tensor it adds: two for a bf16 sum (the upcast and
    the result), one for an fp32 sum of bf16 gradients. The larger unit and the `largest` tensor (gathered
    elements) count. Measured, the tiny MoE at PP 2 x FSDP 2 reducing in bf16: 446 MiB allocated at the peak on
    every rank, in the root unit's add (its 49 MiB fp32 gradient and two 49 MiB temporaries), 335 and 412 predicted
    for the two stages without it. 0 without pp or data parallelism, or where the two dtypes agree."""
    if dims.pp == 1 or not dims.has_data_parallel or reduce == width:
        return 0.0
    return width * max([*blocks, root]) + 4.0 * largest * (2 if reduce < width else 1)


def fsdp_deferred_reduce_bytes(blocks: list[float], root: float, dims: ParallelDims, reduce: float = 4.0) -> float:
    """The reduce-scatter inputs FSDP holds under pp while it reduces the stage's accumulated gradients, unit by
    unit after the last backward: a flat copy (`reduce` bytes an element) of one unit's unsharded gradients, and
    the previous unit's until its reduce completes (torch keeps one in flight: reduce_scatter_max_input_buffers),
    so the two largest units (`blocks` and `root` in unsharded elements, as fsdp_transient_bytes takes them); 0
    where there is no such deferred reduce (no pp, or no data parallelism)."""
    if dims.pp == 1 or not dims.has_data_parallel:
        return 0.0
    return reduce * sum(sorted([*blocks, root], reverse=True)[:2])


def zero_gradient_bytes(mode: str, local: float, owned: float, width: int, buffers: float) -> float:
    """Gradient bytes a zero1/zero2 rank holds (optim/sharded.py): the reduced fp32 shard and the persistent
    communication buffers (`buffers` bytes, optim/buffers.py), plus the whole gradients in the compute dtype:
    zero1 all of them until the step, zero2 those of about two buckets filling during a backward."""
    return whole_gradient_bytes(mode, local, width) + 4.0 * owned + buffers


def _zero_bytes(model: nn.Module, config: Config, dims: ParallelDims) -> dict[str, float]:
    """zero1/zero2 (optim/sharded.py): whole parameters in the compute dtype; gradients whole in the compute
    dtype until the step (zero1) or about two buckets' filling during a backward (zero2), the reduced fp32 shard,
    and the persistent bucket buffers (as the optimizer sizes them: optim/buffers.py); fp32 master (a copy only
    under bf16) + AdamW moments for the owned segments only."""
    from optimus.optim.buffers import buffer_nbytes, zero_layout
    from optimus.optim.sharded import DEFAULT_BUCKET_NUMEL

    width = 2 if config.train.dtype == "bf16" else 4
    local = sum(_local_numel(p) for p in model.parameters())
    mode = config.parallel.shard_mode
    dense_ranks = dims.dp if config.parallel.ep_aware or dims.ep == 1 else dims.expert_dp
    layout = zero_layout(model, dense_ranks, dims.expert_dp, DEFAULT_BUCKET_NUMEL)
    owned = sum(segment for _, segment in layout)  # rank 0's: a whole segment of every bucket (optim/flat.py)
    master = 4.0 * owned if width == 2 else 0.0  # fp32 parameters are their own master weights
    buffers = sum(buffer_nbytes(layout, width, mode == "zero2", config.parallel.grad_reduce_bytes))
    return {
        f"parameters (whole, {config.train.dtype})": width * local,
        ("gradients (whole + fp32 shard + 2 bucket buffers, zero1)" if mode == "zero1" else
         "gradients (fp32 shard + 2 bucket buffers + buckets filling, zero2)"):
            zero_gradient_bytes(mode, local, owned, width, buffers),
        f"optimizer ({'master + ' if master else ''}AdamW, owned segments)": master + 8.0 * owned,
    }


def _build_rank(config: Config, dims: ParallelDims, rank: int) -> nn.Module:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from optimus.parallel.parallelize import build_parallel_model

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    mesh = dims.build_mesh("cpu") if dims.is_parallel else None
    return build_parallel_model(config, dims, mesh, "meta")


def dry_run(config: Config, world_size: int, device_memory_gb: float = 64.0) -> DryRunReport:
    """Apply the configured layout to the model on the meta device as rank 0 (and, with pipeline
    parallelism, as a rank of the last stage) of a `world_size`-rank job; report what each holds.

    Needs a process without a process group (it creates a fake one and destroys it again).
    """
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group: it plays one rank of a fake one")
    if config.train.dtype == "auto":
        # the accelerators a dry run plans for (device_memory_gb) compute bf16 natively: count it as bf16
        config = config.model_copy(update={"train": config.train.model_copy(update={"dtype": "bf16"})})
        notes_on_dtype = ["train.dtype=auto counted as bf16 (what auto picks on accelerators with native bf16)"]
    else:
        notes_on_dtype = []
    layout = validate_layout(config, world_size)  # the trainer's own checks: what it refuses, this refuses
    config, dims = layout.config, layout.dims  # config: with the micro-batch the trainer would use
    from optimus.models.transformer import build_model

    total = sum(q.numel() for q in build_model(config.model, device="meta").parameters())
    ranks_to_show = [0] if dims.pp == 1 else [0, world_size - 1]
    notes: list[str] = notes_on_dtype
    ranks = []
    for rank in ranks_to_show:
        try:
            model = _build_rank(config, dims, rank)
            ranks.append(_measure_rank(model, config, dims, rank))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    if dims.ep > 1:
        per_ep_rank = config.model.n_experts // dims.ep
        notes.append(f"experts: {per_ep_rank} per ep rank, then FSDP-sharded over dp_shard_mod_ep ({dims.dp_shard_mod_ep})")
        if per_ep_rank % dims.dp_shard_mod_ep:
            notes.append(f"{per_ep_rank} experts do not divide over {dims.dp_shard_mod_ep} FSDP ranks: expert weights "
                         f"are sharded along their second dim if it divides, else padded (counted above)")
    return DryRunReport(config, dims, device_memory_gb, ranks, total, notes, layout.batch)


def format_report(report: DryRunReport) -> str:
    """The report as a plain-text table, one column per rank shown."""
    d, cfg = report.dims, report.config
    lines = [
        f"dry run: {cfg.model.preset or 'custom model'} ({report.total_parameters / 1e9:.2f}B parameters) on "
        f"{d.world_size} ranks",
        f"layout: dp_replicate={d.dp_replicate} dp_shard={d.dp_shard} (ep={d.ep}, dp_shard_mod_ep={d.dp_shard_mod_ep}) "
        f"tp={d.tp} pp={d.pp}; micro-batch {cfg.train.micro_batch_size} x {cfg.train.seq_len} tokens, "
        f"dtype {cfg.train.dtype}, activation checkpointing {cfg.train.activation_checkpointing}"
        + (f" ({'+'.join(cfg.train.recompute)})" if cfg.train.activation_checkpointing == "selective" else ""),
        *([report.batch.describe()] if report.batch is not None else []),
        "",
    ]
    headers = [f"rank {r.rank} (stage {r.stage}, {r.layers} layers)" for r in report.ranks]
    modes = list(report.ranks[0].activations_per_micro_batch)
    label_width = max(32, *(len(k) + 2 for k in report.ranks[0].bytes),
                      *(len(f"  (1 micro-batch, ckpt {m})") + 2 for m in modes))
    col = max(26, *(len(h) + 2 for h in headers))
    lines.append(" " * label_width + "".join(h.rjust(col) for h in headers))
    lines.append("parameters on rank".ljust(label_width) + "".join(f"{r.parameters / 1e6:,.1f} M".rjust(col)
                                                                   for r in report.ranks))
    lines.append("micro-batches in flight".ljust(label_width) + "".join(f"{r.in_flight:g}".rjust(col)
                                                                        for r in report.ranks))
    for key in report.ranks[0].bytes:
        cells = [f"{r.bytes[k] / GIB:,.2f} GiB".rjust(col) for r in report.ranks for k in r.bytes if k == key]
        lines.append(key.ljust(label_width) + "".join(cells))
    for mode in modes:
        label = f"  (1 micro-batch, ckpt {mode})"
        lines.append(label.ljust(label_width) + "".join(
            f"{r.activations_per_micro_batch[mode] / GIB:,.2f} GiB".rjust(col) for r in report.ranks))
    lines.append("total".ljust(label_width) + "".join(f"{r.total / GIB:,.2f} GiB".rjust(col) for r in report.ranks))
    budget = report.device_memory_gb * GIB * HEADROOM
    verdicts = ["fits" if r.total <= budget else "DOES NOT FIT" for r in report.ranks]
    lines.append(f"vs {report.device_memory_gb:g} GiB device (90% usable)".ljust(label_width)
                 + "".join(v.rjust(col) for v in verdicts))
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
