"""Parameter and FLOP accounting from a model's config, for `optimus info`, MFU and planning."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from optimus.models.config import ModelConfig


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int  # used per token: all but the (1 - top_k / n_experts) share of expert weights
    embedding: int  # the input embedding table (a lookup, no matmul FLOPs)


def count_parameters(model: nn.Module, config: ModelConfig) -> ParameterCount:
    """Count a built model's parameters (works on the meta device: nothing is allocated)."""
    total = expert = embedding = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if ".experts." in name:
            expert += param.numel()
        if name.startswith("embed."):
            embedding += param.numel()
    inactive = expert - expert * config.top_k // config.n_experts if config.is_moe else 0
    return ParameterCount(total=total, active=total - inactive, embedding=embedding)


def flops_per_token(params: ParameterCount, config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active matmul parameters + attention scores (PaLM's 12 L d S)."""
    matmul_params = params.active - params.embedding
    return 6.0 * matmul_params + 12.0 * config.n_layers * config.d_model * seq_len
