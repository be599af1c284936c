"""One optimizer step: forward/backward over the micro-batches, loss assembly, clipping, update.

Gradient accumulation averages the per-micro-batch objective, so a step over n micro-batches of a
global batch computes the same gradient as one pass over the whole batch (and as any data-parallel
split of it). A step whose gradient is not finite is skipped rather than applied.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

MicroBatch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepResult:
    loss: float
    ce_loss: float
    aux_loss: float | None
    z_loss: float | None
    grad_norm: float
    tokens: int
    skipped: bool
    expert_counts: torch.Tensor | None  # [moe layers, n_experts], summed over micro-batches


def autocast_context(device: torch.device, dtype: str):
    """bf16 autocast for 'bf16' (fp32 master weights and optimizer state); nothing for 'fp32'."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> float:
    """Global gradient L2 norm (returned), clipped to max_norm when max_norm > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.item()


def forward_backward(
    model: nn.Module, micro_batches: list[MicroBatch], device: torch.device, dtype: str
) -> dict[str, torch.Tensor]:
    """Accumulate gradients over micro-batches; returns the batch-mean loss terms (detached)."""
    scale = 1.0 / len(micro_batches)
    sums: dict[str, torch.Tensor] = {}
    for inputs, labels in micro_batches:
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


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    *,
    device: torch.device,
    dtype: str = "fp32",
    grad_clip: float = 0.0,
) -> StepResult:
    """Run one full optimizer step on this rank's micro-batches."""
    optimizer.zero_grad(set_to_none=True)
    sums = forward_backward(model, micro_batches, device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = clip_gradients(params, grad_clip)
    skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return StepResult(
        loss=sums["loss"].item(),
        ce_loss=sums["ce_loss"].item(),
        aux_loss=sums["aux_loss"].item() if "aux_loss" in sums else None,
        z_loss=sums["z_loss"].item() if "z_loss" in sums else None,
        grad_norm=grad_norm,
        tokens=sum(inputs.numel() for inputs, _ in micro_batches),
        skipped=skipped,
        expert_counts=sums.get("expert_counts"),
    )
