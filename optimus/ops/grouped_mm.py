"""Grouped matrix products for dropless MoE: rows sorted by expert, one weight matrix per group.

`grouped_mm(x, w, counts)` computes, for each expert e, x[rows of e] @ w[e], where the rows of
expert e are the `counts[e]` consecutive rows after those of experts 0..e-1. Groups may be empty.
"""

from __future__ import annotations

import torch

GROUPED_MM_IMPLS = ("auto", "reference", "torch")


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Ground truth: one plain matmul per group (a Python loop; for tests and debugging only)."""
    pieces = torch.split(x, counts.tolist(), dim=0)
    return torch.cat([piece @ w[e] for e, piece in enumerate(pieces)], dim=0)


class _TorchGroupedMM(torch.autograd.Function):
    """torch._grouped_mm with a backward that tolerates expanded (stride-0) output gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets)
        return torch._grouped_mm(x, w, offs=offsets)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, w, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad_out, w.transpose(-2, -1), offs=offsets)
        if ctx.needs_input_grad[1]:
            grad_w = torch._grouped_mm(x.transpose(0, 1), grad_out, offs=offsets)
        return grad_x, grad_w, None


def grouped_mm_torch(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """PyTorch's own grouped GEMM (CPU, and CUDA sm90+)."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    return _TorchGroupedMM.apply(x, w, offsets)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x: [M, K] rows sorted by group; w: [E, K, N]; counts: [E] rows per group (sum M) -> [M, N]."""
    if impl == "reference":
        return grouped_mm_reference(x, w, counts)
    if impl in ("auto", "torch"):
        return grouped_mm_torch(x, w, counts)
    raise ValueError(f"unknown grouped_mm impl '{impl}': choose one of {GROUPED_MM_IMPLS}")
