"""Every rule a job's layout and batch must meet, checked in one place before anything runs or is written.

The config (at load, for the world size its degrees imply), the dry run, the planner and the trainer
all call `validate_layout`, so a layout the dry run approves is one the trainer accepts. Each rule
raises LayoutError (a ConfigError) with one line naming the problem and the fix. The rules:

    degrees      each >= 1; dp_replicate x dp_shard x tp x pp = world size; ep divides dp_shard
    model        tp divides the query and KV heads; ep > 1 needs an MoE model and divides its experts;
                 ep x tp divides the experts (tp ranks split each ep rank's experts);
                 pp x virtual stages <= layers; tp divides train.seq_len (sequence parallelism)
    pipeline     pp_virtual_stages > 1 exactly with pp_schedule=interleaved_1f1b;
                 1f1b needs at least pp micro-batches per step; interleaved 1F1B a count torch's
                 schedule can split into rounds
    batch        the data-parallel ranks divide the global batch; the micro-batch divides each rank's share
    checkpointing  selective_ops with ep = dp_shard under dp_replicate > 1 is refused (see parallelize.py)
    shard mode   ddp (torch DDP, whole replicas) only for pure data parallelism: tp = pp = ep = 1

The global batch is the contract; the micro-batch is a memory knob. When train.micro_batch_size is
not set it is derived: each rank's share in one micro-batch, or, under pipeline parallelism, split
into the fewest micro-batches the schedule accepts (at least pp, so the bubble stays small).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optimus.parallel.mesh import LayoutError, ParallelDims

if TYPE_CHECKING:
    from optimus.config import Config
    from optimus.train.config import TrainConfig


@dataclass(frozen=True)
class BatchLayout:
    """How one step's global batch is split: over data-parallel ranks, then into micro-batches."""

    global_batch_size: int
    dp: int
    micro_batch_size: int
    derived: bool  # True when train.micro_batch_size was not set and the micro-batch was chosen here

    @property
    def per_rank(self) -> int:
        """Samples each data-parallel rank processes per step."""
        return self.global_batch_size // self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches (gradient-accumulation steps, or pipeline micro-batches) per step on each rank."""
        return self.per_rank // self.micro_batch_size

    def describe(self) -> str:
        """One line for the log: the split, and whether the micro-batch was derived."""
        how = ("derived: train.micro_batch_size not set" if self.derived
               else "train.micro_batch_size as configured")
        return (f"batch: global {self.global_batch_size} = {self.dp} data-parallel rank(s) x {self.per_rank}; "
                f"{self.micro_batches} micro-batch(es) of {self.micro_batch_size} per step ({how})")


@dataclass(frozen=True)
class Layout:
    """A validated job: its parallel degrees, its batch split, and the config with the micro-batch filled in."""

    dims: ParallelDims
    batch: BatchLayout
    config: "Config"


def validate_layout(config: "Config", world_size: int | None = None) -> Layout:
    """Check every layout and batch rule for a job of `world_size` ranks (default: the product of the
    configured degrees); raise LayoutError with one line, or return the resolved Layout."""
    p, train = config.parallel, config.train
    dims = ParallelDims.from_config(p, world_size)
    if dims.pp > 1:
        check_pipeline_schedule(p.pp_schedule, p.pp_virtual_stages)
        if train.eval_tasks:  # ranking needs every logit, and no pipeline rank holds the whole model
            raise LayoutError("train.eval_tasks is not supported with parallel.pp > 1: leave train.eval_tasks empty "
                              "and score the run afterwards with `optimus eval RUN --tasks ...`")
    virtual_stages = p.pp_virtual_stages if dims.pp > 1 else 1
    dims.check_model(config.model, virtual_stages, seq_len=train.seq_len)
    batch = resolve_batch(train, dims, p.pp_schedule)
    if dims.pp > 1:
        check_pipeline_micro_batches(p.pp_schedule, dims.pp, batch.micro_batches)
    check_checkpointing_layout(train.activation_checkpointing, dims)
    check_shard_mode(p.shard_mode, dims)
    resolved = config
    if batch.derived:
        resolved = config.model_copy(
            update={"train": train.model_copy(update={"micro_batch_size": batch.micro_batch_size})})
    return Layout(dims, batch, resolved)


def check_pipeline_schedule(schedule: str, virtual_stages: int) -> None:
    """Virtual stages go with the interleaved schedule and only with it."""
    if schedule != "interleaved_1f1b" and virtual_stages != 1:
        raise LayoutError(f"parallel.pp_virtual_stages ({virtual_stages}) > 1 needs parallel.pp_schedule="
                          f"interleaved_1f1b (got {schedule}): set pp_virtual_stages=1 or change the schedule")
    if schedule == "interleaved_1f1b" and virtual_stages < 2:
        raise LayoutError("parallel.pp_schedule=interleaved_1f1b needs parallel.pp_virtual_stages >= 2: "
                          "set pp_virtual_stages=2 (or use pp_schedule=1f1b)")


def _schedule_accepts(schedule: str, pp: int, n_micro: int) -> bool:
    if schedule == "1f1b":
        return n_micro >= pp
    if schedule == "interleaved_1f1b":  # torch splits the micro-batches into rounds of about pp
        return n_micro % max(1, n_micro // pp) == 0
    return True  # gpipe: any count (fewer than pp leaves stages idle, but it runs)


def check_pipeline_micro_batches(schedule: str, pp: int, n_micro: int) -> None:
    """Refuse a micro-batch count per step that the pipeline schedule cannot run."""
    if _schedule_accepts(schedule, pp, n_micro):
        return
    if schedule == "1f1b":
        raise LayoutError(
            f"parallel.pp_schedule=1f1b needs at least pp ({pp}) micro-batches per step, got {n_micro} "
            f"(train.global_batch_size / (data-parallel ranks x train.micro_batch_size)): use smaller micro-batches, "
            f"a larger global batch, or pp_schedule=gpipe")
    raise LayoutError(
        f"parallel.pp_schedule=interleaved_1f1b cannot split {n_micro} micro-batches per step into rounds of pp "
        f"({pp}): use a multiple of {pp} micro-batches (train.global_batch_size / (data-parallel ranks x "
        f"train.micro_batch_size))")


def resolve_batch(train: "TrainConfig", dims: ParallelDims, schedule: str = "1f1b") -> BatchLayout:
    """The batch split for these degrees: train.micro_batch_size if set (it must divide each rank's share),
    else derived (see the module docstring)."""
    global_batch, dp = train.global_batch_size, dims.dp
    if global_batch % dp:
        raise LayoutError(
            f"train.global_batch_size ({global_batch}) is not divisible by the {dp} data-parallel ranks "
            f"(dp_replicate x dp_shard): use a multiple of {dp}")
    per_rank = global_batch // dp
    micro = train.micro_batch_size
    if micro is not None:
        if per_rank % micro:
            raise LayoutError(
                f"each of the {dp} data-parallel ranks gets {per_rank} samples (train.global_batch_size / dp), not "
                f"divisible by train.micro_batch_size ({micro}): use a divisor of {per_rank}, or leave "
                f"train.micro_batch_size unset to derive it")
        return BatchLayout(global_batch, dp, micro, derived=False)
    wanted = dims.pp if dims.pp > 1 else 1
    for n_micro in divisors(per_rank):
        if n_micro >= wanted and _schedule_accepts(schedule, dims.pp, n_micro):
            return BatchLayout(global_batch, dp, per_rank // n_micro, derived=True)
    # fewer samples per rank than the schedule needs micro-batches: one sample each, and the check refuses it
    if schedule == "1f1b":
        raise LayoutError(
            f"parallel.pp_schedule=1f1b needs at least pp ({dims.pp}) micro-batches per step but each of the {dp} "
            f"data-parallel ranks gets only {per_rank} samples: raise train.global_batch_size to a multiple of "
            f"{dp * dims.pp} (data-parallel ranks x pp) or use pp_schedule=gpipe")
    return BatchLayout(global_batch, dp, 1, derived=True)


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n): a per-rank share of 10^8 samples took 10 s counted up
    one by one, and the planner's search (plan/search.py) enumerates the degrees of a large --devices by them."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def check_checkpointing_layout(mode: str, dims: ParallelDims) -> None:
    """Op-level checkpointing replays ops by count, which the experts' one-rank FSDP group breaks under HSDP."""
    if (mode == "selective_ops" and dims.is_parallel and dims.ep > 1 and dims.dp_shard_mod_ep == 1
            and dims.dp_replicate > 1):
        raise LayoutError("train.activation_checkpointing=selective_ops does not work with parallel.ep = dp_shard "
                          "under dp_replicate > 1 (its op replay conflicts with the experts' one-rank FSDP shard): "
                          "use selective (train.recompute) or full")


def check_shard_mode(mode: str, dims: ParallelDims) -> None:
    """DDP replicates plain whole tensors over every rank: it composes with no model-splitting parallelism.

    (torch DDP does not reduce DTensor parameters over a sub-mesh, and tp/pp/ep ranks hold different
    pieces of the model, so they are not replicas; torchtitan refuses the same combinations.)
    """
    if mode != "ddp":
        return
    others = {name: degree for name, degree in (("tp", dims.tp), ("pp", dims.pp), ("ep", dims.ep)) if degree > 1}
    if others:
        got = ", ".join(f"parallel.{name}={degree}" for name, degree in others.items())
        raise LayoutError(f"parallel.shard_mode=ddp is for pure data parallelism and does not compose with {got}: "
                          f"use shard_mode=fsdp (or zero1/zero2) with them, or set {' and '.join(others)} to 1")
