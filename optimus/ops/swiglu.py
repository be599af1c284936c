"""SwiGLU activation on a merged gate+up projection, with an optional per-row scale.

The expert MLP computes gate and up in one grouped GEMM, so its output h is [rows, 2F] with the
gate in the first half. `swiglu(h)` returns silu(gate) * up. The fast versions save only h and
recompute silu in backward (one fewer activation kept per layer). `swiglu_forward` and
`swiglu_backward` are the primitives the fused expert path calls; their `row_scale` carries the
router weight of each row, so that the combine after the down projection is a plain sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optimus.ops._device import check_impl, triton_runs_on


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Ground truth: silu(first half) * second half, with plain autograd."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _torch_forward(h: torch.Tensor, row_scale: torch.Tensor | None) -> torch.Tensor:
    width = h.shape[-1] // 2
    out = F.silu(h[..., :width])
    out.mul_(h[..., width:])
    if row_scale is not None:
        out.mul_(row_scale.to(out.dtype).view(*row_scale.shape, 1))
    return out


def _torch_backward(
    h: torch.Tensor, grad: torch.Tensor, row_scale: torch.Tensor | None, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    width = h.shape[-1] // 2
    dh = h if in_place else torch.empty_like(h)
    gate, up = h[..., :width], h[..., width:]
    silu = F.silu(gate)
    dscale = None
    if row_scale is not None:
        dscale = torch.linalg.vecdot(grad, silu * up).to(row_scale.dtype)
        grad = grad * row_scale.to(h.dtype).unsqueeze(-1)
    # With in_place, dh's halves alias gate and up: up is read before its half is overwritten,
    # and silu_backward reads each gate element before writing the same element.
    grad_times_up = grad * up
    torch.mul(grad, silu, out=dh[..., width:])
    torch.ops.aten.silu_backward.grad_input(grad_times_up, gate, grad_input=dh[..., :width])
    return dh, dscale


def swiglu_forward(h: torch.Tensor, row_scale: torch.Tensor | None = None, backend: str = "torch") -> torch.Tensor:
    """No-autograd SwiGLU: [..., 2F] -> [..., F], times row_scale[...] per row when given."""
    if backend == "triton":
        from optimus.ops.triton.swiglu import swiglu_forward as triton_forward

        return triton_forward(h, row_scale)
    return _torch_forward(h, row_scale)


def swiglu_backward(
    h: torch.Tensor,
    grad: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    backend: str = "torch",
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No-autograd SwiGLU gradient: (d h, d row_scale or None). in_place reuses h's memory for dh."""
    if backend == "triton":
        from optimus.ops.triton.swiglu import swiglu_backward as triton_backward

        return triton_backward(h, grad, row_scale, in_place=in_place)
    return _torch_backward(h, grad, row_scale, in_place=in_place and h.is_contiguous())


class _SwiGLU(torch.autograd.Function):
    """Saves only the gate+up input; backward recomputes the activation."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, backend: str) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        ctx.backend = backend
        return swiglu_forward(gate_up, backend=backend)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        grad_in, _ = swiglu_backward(gate_up, grad_out.contiguous(), backend=ctx.backend)
        return grad_in, None


def swiglu(gate_up: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """gate_up: [..., 2F] with the gate in the first half -> silu(gate) * up, [..., F].

    impl: "auto" (Triton on GPUs where it runs, else "torch"), "reference" (plain autograd),
    "torch" (custom backward that saves only gate_up), "triton".
    """
    check_impl(impl)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dimension, got {gate_up.shape[-1]}")
    if impl == "reference":
        return swiglu_reference(gate_up)
    if impl == "auto":
        impl = "triton" if triton_runs_on(gate_up.device) else "torch"
    return _SwiGLU.apply(gate_up, impl)
