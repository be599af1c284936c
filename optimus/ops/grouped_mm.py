"""Grouped matrix products for dropless MoE: rows sorted by expert, one weight matrix per group.

`grouped_mm(x, w, counts)` computes, for each expert e, x[rows of e] @ w[e], where the rows of
expert e are the `counts[e]` consecutive rows after those of experts 0..e-1. Groups may be empty.

Three GEMM shapes cover forward and backward, and every backend provides the two primitives:
  rows:  out[rows of e] = a[rows of e] @ b[e]      forward (b = w) and dgrad (b = w^T, a view)
  wgrad: out[e] = a[rows of e]^T @ g[rows of e]    weight gradient, zeros for an empty group
Backends: "loop" (one BLAS call per group, the fastest on CPU), "torch" (torch._grouped_mm),
"triton" (our kernels in ops/triton/). The fused expert path in ops/experts.py reuses them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from optimus.ops._device import (
    check_impl,
    compute_dtype,
    torch_grouped_mm_accepts,
    torch_grouped_mm_fast_on,
    triton_runs_on,
)
from optimus.ops.routing import Groups

GROUPED_MM_IMPLS = ("auto", "reference", "loop", "torch", "triton")


class GemmBackend(NamedTuple):
    """The two grouped-GEMM primitives of one implementation (see the module docstring)."""

    name: str
    rows: Callable[..., torch.Tensor]  # (a [M,K], b [E,K,N], groups) -> [M,N]
    wgrad: Callable[..., torch.Tensor]  # (a [M,K], g [M,N], groups) -> [E,K,N]


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Ground truth: one plain matmul per group (a Python loop; for tests and debugging only)."""
    pieces = torch.split(x, counts.tolist(), dim=0)
    return torch.cat([piece @ w[e] for e, piece in enumerate(pieces)], dim=0)


def _loop_rows(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    out = a.new_empty(a.shape[0], b.shape[2])
    for group, start, stop in groups.spans():
        torch.mm(a[start:stop], b[group], out=out[start:stop])
    return out


def _loop_wgrad(a: torch.Tensor, g: torch.Tensor, groups: Groups) -> torch.Tensor:
    # torch.empty, not zeros: only the empty groups need zeroing, the rest is overwritten
    out = a.new_empty(groups.n_groups, a.shape[1], g.shape[1])
    start = 0
    for group, count in enumerate(groups.host):
        if count:
            torch.mm(a[start : start + count].t(), g[start : start + count], out=out[group])
        else:
            out[group].zero_()
        start += count
    return out


def _torch_rows(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=groups.ends)


def _torch_wgrad(a: torch.Tensor, g: torch.Tensor, groups: Groups) -> torch.Tensor:
    return torch._grouped_mm(a.t(), g, offs=groups.ends)


def _triton_rows(a: torch.Tensor, b: torch.Tensor, groups: Groups) -> torch.Tensor:
    from optimus.ops.triton.grouped_mm import grouped_mm_rows

    return grouped_mm_rows(a, b, groups.ends)


def _triton_wgrad(a: torch.Tensor, g: torch.Tensor, groups: Groups) -> torch.Tensor:
    from optimus.ops.triton.grouped_mm import grouped_mm_wgrad

    return grouped_mm_wgrad(a, g, groups.ends)


BACKENDS = {
    "loop": GemmBackend("loop", _loop_rows, _loop_wgrad),
    "torch": GemmBackend("torch", _torch_rows, _torch_wgrad),
    "triton": GemmBackend("triton", _triton_rows, _triton_wgrad),
}


def pick_gemm_backend(impl: str, x: torch.Tensor, w: torch.Tensor) -> GemmBackend:
    """The grouped-GEMM backend for `impl` on x's device ("auto": the fastest one known there)."""
    if impl != "auto":
        if impl == "torch" and not torch_grouped_mm_accepts(x, w):
            raise ValueError("torch._grouped_mm needs every row stride to be a multiple of 16 bytes")
        return BACKENDS[impl]
    if x.device.type == "cpu":
        return BACKENDS["loop"]
    if torch_grouped_mm_fast_on(x.device, w.dtype) and torch_grouped_mm_accepts(x, w):
        return BACKENDS["torch"]
    if triton_runs_on(x.device):
        return BACKENDS["triton"]
    return BACKENDS["loop"]


class _GroupedMM(torch.autograd.Function):
    """Grouped GEMM with dgrad and wgrad from the same backend's primitives."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, groups: Groups, backend: GemmBackend) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.groups, ctx.backend = groups, backend
        return backend.rows(x, w, groups)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, w = ctx.saved_tensors
        # an expanded gradient (e.g. from y.sum()) has stride 0, which GEMMs reject
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.backend.rows(grad_out, w.transpose(1, 2), ctx.groups)
        if ctx.needs_input_grad[1]:
            grad_w = ctx.backend.wgrad(x, grad_out, ctx.groups)
        return grad_x, grad_w, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x: [M, K] rows sorted by group; w: [E, K, N]; counts: [E] rows per group (sum M) -> [M, N].

    Differentiable in x and w. impl: "auto" (per device: a BLAS call per group on CPU,
    torch._grouped_mm on CUDA sm90+ in bf16, Triton on other GPUs), "reference", "loop",
    "torch" or "triton". Under autocast the math runs in the autocast dtype.
    """
    check_impl(impl, GROUPED_MM_IMPLS)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or counts.numel() != w.shape[0]:
        raise ValueError(f"grouped_mm shapes disagree: x {tuple(x.shape)}, w {tuple(w.shape)}, counts {tuple(counts.shape)}")
    dtype = compute_dtype(x, w)
    x, w = x.to(dtype), w.to(dtype)
    if impl == "reference":
        return grouped_mm_reference(x, w, counts)
    backend = pick_gemm_backend(impl, x, w)
    return _GroupedMM.apply(x, w, Groups(counts), backend)
