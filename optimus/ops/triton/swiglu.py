"""Triton SwiGLU on a merged gate+up projection, optionally scaled per row.

forward:  out[r] = scale[r] * silu(h[r, :F]) * h[r, F:]
backward: from h, scale and dout: dh (may overwrite h in place: each element is read before it
          is written, by the same program) and dscale[r] = <dout[r], silu(gate) * up>.
The row scale carries the router weight into the expert MLP, so the down projection's output
is already weighted and the combine is a plain sum. Math in fp32, one pass each way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimus.ops.triton._launch import cdiv, interpreting


@triton.jit
def _swiglu_forward_kernel(
    h_ptr, scale_ptr, out_ptr, F, stride_h, stride_out,
    HAS_SCALE: tl.constexpr, BLOCK_F: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = offs < F
    gate = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + F + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    if HAS_SCALE:
        out *= tl.load(scale_ptr + row).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    h_ptr, scale_ptr, dout_ptr, dh_ptr, dscale_ptr, F, stride_h, stride_dout, stride_dh,
    HAS_SCALE: tl.constexpr, BLOCK_F: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr + row).to(tl.float32)
    dot = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        offs = f0 + tl.arange(0, BLOCK_F)
        mask = offs < F
        gate = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * stride_h + F + offs, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(dout_ptr + row * stride_dout + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        dot += grad * silu * up
        grad_act = grad * scale
        dgate = grad_act * up * (sig + silu * (1.0 - sig))
        tl.store(dh_ptr + row * stride_dh + offs, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + row * stride_dh + F + offs, (grad_act * silu).to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_SCALE:
        tl.store(dscale_ptr + row, tl.sum(dot, axis=0).to(dscale_ptr.dtype.element_ty))


def _block_f(kernel, width: int, cap: int) -> int:
    if interpreting(kernel):
        return 32
    return min(cap, triton.next_power_of_2(max(width, 16)))


def _rows_of(h: torch.Tensor) -> torch.Tensor:
    flat = h.reshape(-1, h.shape[-1])
    return flat if flat.stride(1) == 1 else flat.contiguous()


def swiglu_forward(h: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """[..., 2F] -> [..., F] = silu(gate) * up, times row_scale[row] when given."""
    width = h.shape[-1] // 2
    flat = _rows_of(h)
    out = flat.new_empty(flat.shape[0], width)
    if out.numel():
        block = _block_f(_swiglu_forward_kernel, width, 1024)
        _swiglu_forward_kernel[(flat.shape[0], cdiv(width, block))](
            flat, row_scale if row_scale is not None else flat, out, width, flat.stride(0), out.stride(0),
            HAS_SCALE=row_scale is not None, BLOCK_F=block,
        )
    return out.view(*h.shape[:-1], width)


def swiglu_backward(
    h: torch.Tensor, grad: torch.Tensor, row_scale: torch.Tensor | None = None, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dh like h, dscale [rows] or None); in_place=True writes dh over h (h must be contiguous)."""
    width = h.shape[-1] // 2
    flat = _rows_of(h)
    grad = grad.reshape(-1, width).contiguous()
    dh = flat if in_place else torch.empty_like(flat)
    dscale = row_scale.new_empty(flat.shape[0]) if row_scale is not None else None
    if flat.shape[0] and width:
        block = _block_f(_swiglu_backward_kernel, width, 512)
        _swiglu_backward_kernel[(flat.shape[0],)](
            flat, row_scale if row_scale is not None else flat, grad, dh,
            dscale if dscale is not None else flat,
            width, flat.stride(0), grad.stride(0), dh.stride(0),
            HAS_SCALE=row_scale is not None, BLOCK_F=block,
        )
    elif dscale is not None:
        dscale.zero_()
    return dh.view(h.shape), dscale
