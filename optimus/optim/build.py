"""Parameter groups and the optimizer: AdamW with no weight decay on norms, biases and embeddings."""

from __future__ import annotations

import torch
from torch import nn

from optimus.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices that decay, and norms/biases/embeddings that do not (OLMo's choice)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or "norm" in name or name.startswith("embed") or ".embed." in name:
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the model's parameter groups; the learning rate is set every step by the trainer."""
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        foreach=True,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Apply one learning rate to every group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
