"""Building blocks shared by every decoder: RMSNorm, rotary embedding, SwiGLU MLP, the LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from optimus.ops.cross_entropy import linear_cross_entropy


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as OLMoE and OLMo-2 do."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # one upcast (a copy for bf16 input, a no-op for fp32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim] in the rotate-half convention of Llama/OLMoE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SwiGLUMLP(nn.Module):
    """Dense feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LMHead(nn.Linear):
    """The output projection to vocabulary logits (no bias), and the fused loss on the same weight.

    The loss is a method of the head, not of the model, so that a parallel layout can swap the head
    for one with its own loss (tensor parallelism: optimus.parallel.vocab_parallel) while the model
    code stays single-device.
    """

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__(d_model, vocab_size, bias=False)

    def cross_entropy(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the logits of h [..., D] against labels [...] (-100 ignored), without
        holding the full logits (ops.cross_entropy)."""
        return linear_cross_entropy(h.flatten(0, -2), self.weight, labels.flatten())
