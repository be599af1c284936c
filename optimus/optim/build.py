"""Parameter groups and the optimizer: AdamW with no weight decay on norms, biases and embeddings."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from optimus.optim.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices that decay, and norms/biases/embeddings that do not (OLMo's choice); each split again into
    DTensor and plain parameters where a model has both (tp without FSDP: a MoE router stays a plain tensor),
    since AdamW's fused and foreach kernels refuse a mix in one group. Empty groups are left out."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decays = not (param.ndim < 2 or "norm" in name or name.startswith("embed") or ".embed." in name)
        groups.setdefault((decays, isinstance(param, DTensor)), []).append(param)
    return [{"params": params, "weight_decay": weight_decay if decays else 0.0}
            for (decays, _), params in sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1]))]


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the model's parameter groups; the learning rate is set every step by the trainer.

    A model parallelized with parallel.shard_mode zero1/zero2 carries a `zero_plan`: it gets the
    distributed optimizer (optim/sharded.py) instead, with the same param groups and hyperparameters.
    """
    plan = getattr(model, "zero_plan", None)
    if plan is not None:
        from optimus.optim.sharded import ShardedOptimizer

        return ShardedOptimizer(model, config, plan)
    groups = param_groups(model, config.weight_decay)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, **adamw_kernel(groups))


def fused_adamw_runs_on(device_type: str) -> bool:
    """Whether torch has a fused AdamW kernel for this device type (cpu, cuda and ROCm, xpu, mps, ...)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch without the list (private): the kinds every torch we support fuses on
        return device_type in ("cpu", "cuda")
    return device_type in _get_fused_kernels_supported_devices()


def adamw_kernel(groups: list[dict]) -> dict:
    """fused=True where torch has the kernel (CPU, CUDA and ROCm, XPU...), DTensor parameters (FSDP2, TP, EP shards)
    included; else foreach.

    The fused kernel makes one pass over param, grad and both moments: 6x faster than foreach on a
    52M-parameter model on CPU (35 vs 215 ms per step on one EPYC core). DTensor runs it on each local
    shard (a pointwise op); foreach on DTensors fell back to one call per parameter and per operator
    (5.7x slower on 8 sharded 4M-element parameters, bitwise-equal results).
    """
    device_types = {p.device.type for group in groups for p in group["params"]}
    if device_types and all(fused_adamw_runs_on(kind) for kind in device_types):
        return {"fused": True}
    return {"foreach": True}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Apply one learning rate to every group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
