"""One optimizer step: forward/backward over the micro-batches, loss assembly, clipping, update.

Gradient accumulation averages the per-micro-batch objective, so a step over n micro-batches of a
global batch computes the same gradient as one pass over the whole batch (and as any data-parallel
split of it). A step whose loss or gradient is not finite is skipped rather than applied, and so is one
the caller's `skip_step` rejects (a loss spike): the decision is taken on the global batch's loss and
gradient norm, the same numbers on every rank, so all ranks skip or step together.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from optimus.parallel.data_parallel import set_gradient_sync
from optimus.parallel.pipeline import get_pipeline
from optimus.parallel.partial_grads import reduce_partial_gradients

MicroBatch = tuple[torch.Tensor, torch.Tensor]
SkipReason = Literal["non-finite", "loss spike"]


@dataclass
class StepResult:
    loss: float
    ce_loss: float
    aux_loss: float | None
    z_loss: float | None
    grad_norm: float
    tokens: int
    skipped: bool  # the optimizer step was not applied; skip_reason says why
    expert_counts: torch.Tensor | None  # [moe layers, n_experts], summed over micro-batches and data-parallel ranks
    skip_reason: SkipReason | None = None
    # this data-parallel rank's own expert_counts (its batch alone): its expert-exchange group's sum tells which
    # group's busiest rank paced the step (train/callbacks/step_metrics.ExpertLoadMetrics)
    rank_expert_counts: torch.Tensor | None = None


def autocast_context(device: torch.device, dtype: str):
    """bf16 autocast for 'bf16' (fp32 master weights and optimizer state); nothing for 'fp32'.

    'auto' must be resolved for the device first (optimus.train.precision.choose_precision).
    """
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if dtype != "fp32":
        raise ValueError(f"training dtype {dtype!r} is not resolved: pass 'fp32' or 'bf16' (choose_precision)")
    return contextlib.nullcontext()


def _norm_groups(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters with gradients grouped by layout (plain, or one DTensor mesh + placements).

    torch's norm and clip helpers refuse a mix of plain tensors and DTensors (and of meshes), so
    each group is handled on its own. Groups are formed in parameter order: every rank of a mesh
    meets the same groups in the same order, so the collectives below line up.
    """
    groups: dict[object, list[nn.Parameter]] = {}
    for param in params:
        if param.grad is None:
            continue
        grad = param.grad
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else "plain"
        groups.setdefault(key, []).append(param)
    return list(groups.values())


def _local_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """This rank's sum of squares of gradients that share one mesh and placements (or are all plain tensors), in
    fp32: the local shards' (DTensor's own norm of a list would reduce each gradient's partial norm on its own,
    about 100 all-reduces a step on the tiny model, each over every mesh dim in turn)."""
    local = [grad.to_local() for grad in grads] if isinstance(grads[0], DTensor) else grads
    return torch.nn.utils.get_total_norm(local, norm_type=2.0).float().pow(2)


def _sharding_dims(grad: torch.Tensor) -> list[tuple[tuple[int, ...], tuple]]:
    """(its ranks, (mesh, dim)) of each mesh dim of more than one rank that shards a DTensor gradient (Shard, or
    FSDP-over-TP's _StridedShard, which is_shard() denies; replicated dims hold copies, counted once)."""
    if not isinstance(grad, DTensor):
        return []
    mesh = grad.device_mesh
    return [(tuple(dist.get_process_group_ranks(mesh.get_group(dim))), (mesh, dim))
            for dim, placement in enumerate(grad.placements) if not placement.is_replicate() and mesh.size(dim) > 1]


def _global_squares(groups: list[list[nn.Parameter]]) -> list[torch.Tensor]:
    """Each group's squared norm summed over the ranks that shard it. One all-reduce per distinct set of ranks,
    carrying every group it shards: the groups of a layout share their ranks (FSDP's, tp's, ep's), so FSDP x tp
    reduces twice where a call per group and dim made five, an MoE under FSDP x tp x ep at most three instead of
    nine (two where ep spans FSDP's ranks).
    Every rank meets the sets in the same order (the groups are in parameter order), so the calls line up."""
    squares = [_local_squares([p.grad for p in group]) for group in groups]
    by_ranks: dict[tuple[int, ...], tuple[tuple, list[int]]] = {}
    for index, group in enumerate(groups):
        for ranks, mesh_dim in _sharding_dims(group[0].grad):
            by_ranks.setdefault(ranks, (mesh_dim, []))[1].append(index)
    for mesh_dim, members in by_ranks.values():  # a group sharded over two sets is summed over one, then the other
        reduced = funcol.all_reduce(torch.stack([squares[i] for i in members]), "sum", mesh_dim)
        for position, index in enumerate(members):
            squares[index] = reduced[position]
    return squares


def clip_gradients(params: list[nn.Parameter], max_norm: float, pp_mesh=None) -> float:
    """Global gradient L2 norm (returned), clipped to max_norm when max_norm > 0.

    Works for plain, FSDP-sharded and tensor-parallel (DTensor) gradients: a DTensor group's squared
    norm is summed over its local shards, then over the ranks of the mesh dims that shard it (_global_squares: one
    all-reduce per distinct set of ranks; replicated dims counted once). Under pipeline parallelism pass the pp
    mesh: each stage holds different parameters, so the squared norms are summed over the stages too. The
    result is the same on every rank. Gradients DTensor left as Partial sums (the sequence-parallel norms') are
    summed first, together and in place, so the optimizer step reads them reduced too.
    """
    reduce_partial_gradients(params)
    groups = _norm_groups(params)
    squares = _global_squares(groups)
    # on the parameters' device: the pp group's backend (NCCL on GPUs) reduces device tensors only
    device = params[0].device if params else torch.device("cpu")
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_mesh is not None:
        total_sq = funcol.all_reduce(total_sq, "sum", pp_mesh)
    total = total_sq.sqrt()
    if max_norm > 0 and squares:
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total.item()


def forward_backward(
    model: nn.Module, micro_batches: list[MicroBatch], device: torch.device, dtype: str,
    defer_grad_sync: str = "replicate",
) -> dict[str, torch.Tensor]:
    """Accumulate gradients over micro-batches; returns the batch-mean loss terms (detached).

    defer_grad_sync: which data-parallel gradient reductions wait for the last micro-batch
    (optimus.parallel.data_parallel.set_gradient_sync).
    """
    scale = 1.0 / len(micro_batches)
    sums: dict[str, torch.Tensor] = {}
    for index, (inputs, labels) in enumerate(micro_batches):
        set_gradient_sync(model, last_micro_batch=index == len(micro_batches) - 1, defer=defer_grad_sync)
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast_context(device, dtype):
            out = model(inputs, labels)
        (out.loss * scale).backward()
        for key in ("loss", "ce_loss", "aux_loss", "z_loss", "expert_counts"):
            value = getattr(out, key)
            if value is None:
                continue
            value = value.detach() if key == "expert_counts" else value.detach() * scale
            sums[key] = sums[key] + value if key in sums else value
    return sums


def average_over_dp(sums: dict[str, torch.Tensor], dp_mesh) -> dict[str, torch.Tensor]:
    """Loss terms averaged and expert counts summed over the data-parallel ranks.

    Each rank's loss is the mean over the same number of micro-batches of equal size, so the mean
    of the ranks' losses is the global batch's loss. One all-reduce carries every term.
    """
    keys = [key for key in ("loss", "ce_loss", "aux_loss", "z_loss") if key in sums]
    packed = torch.stack([sums[key].float() for key in keys])
    if "expert_counts" in sums:
        packed = torch.cat([packed / dp_mesh.size(), sums["expert_counts"].float().flatten()])
    else:
        packed = packed / dp_mesh.size()
    reduced = funcol.all_reduce(packed, "sum", dp_mesh)
    out = {key: reduced[i] for i, key in enumerate(keys)}
    if "expert_counts" in sums:
        counts = sums["expert_counts"]
        out["expert_counts"] = reduced[len(keys):].view(counts.shape).to(counts.dtype)
    return out


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    *,
    device: torch.device,
    dtype: str = "fp32",
    grad_clip: float = 0.0,
    dp_mesh=None,
    skip_step: Callable[[float], bool] | None = None,
    defer_grad_sync: str = "replicate",
) -> StepResult:
    """Run one full optimizer step on this rank's micro-batches.

    With `dp_mesh` (the data-parallel DeviceMesh), the losses are averaged and the expert counts summed
    over the data-parallel ranks, so every rank sees the global batch's numbers. `skip_step(loss)` is
    asked, before the update and only for a finite loss and gradient norm, whether to skip the step
    for that global loss; it must decide the same on every rank (it sees the same numbers there).
    """
    optimizer.zero_grad(set_to_none=True)
    # the phases are named for profilers (benchmarks/step_profile.py reads the GPU's idle time per phase)
    # --- pipeline parallel path (optimus.parallel.pipeline): the schedule runs forward + backward ---
    pipeline = get_pipeline(model)
    with record_function("optimus.forward_backward"):
        if pipeline is not None:
            sums = pipeline.forward_backward(micro_batches, device, autocast_context(device, dtype))
        else:
            sums = forward_backward(model, micro_batches, device, dtype, defer_grad_sync)
    with record_function("optimus.clip_gradients"):
        if hasattr(optimizer, "clip_grad_norm_"):  # zero1/zero2: the norm of the reduced gradient shards
            grad_norm = optimizer.clip_grad_norm_(grad_clip)
        else:
            params = [p for p in model.parameters() if p.requires_grad]
            # each pp rank holds other parameters: the norm sums over the stages
            grad_norm = clip_gradients(params, grad_clip,
                                       pp_mesh=pipeline.pp_mesh if pipeline is not None else None)
    # --- end pipeline parallel path ---
    # the pp path's sums are already equal on every stage; averaged over dp they are the global batch's
    rank_expert_counts = sums.get("expert_counts")
    if dp_mesh is not None and dp_mesh.size() > 1:
        sums = average_over_dp(sums, dp_mesh)
    # every loss term in one device-to-host copy, before the update: read after it, each would make the host wait
    # for the optimizer step instead of going on to the next step's batch while the device runs it
    terms = [key for key in ("loss", "ce_loss", "aux_loss", "z_loss") if key in sums]
    values = dict(zip(terms, torch.stack([sums[key].float() for key in terms]).tolist()))
    loss = values["loss"]
    skip_reason: SkipReason | None = None
    if not (math.isfinite(grad_norm) and math.isfinite(loss)):
        skip_reason = "non-finite"
    elif skip_step is not None and skip_step(loss):
        skip_reason = "loss spike"
    with record_function("optimus.optimizer_step"):
        if skip_reason is None:
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=loss,
        ce_loss=values["ce_loss"],
        aux_loss=values.get("aux_loss"),
        z_loss=values.get("z_loss"),
        grad_norm=grad_norm,
        tokens=sum(inputs.numel() for inputs, _ in micro_batches),
        skipped=skip_reason is not None,
        expert_counts=sums.get("expert_counts"),
        skip_reason=skip_reason,
        rank_expert_counts=rank_expert_counts,
    )
