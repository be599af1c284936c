"""Triton token permutation: gather token copies into expert order, and the weighted combine back.

gather:   out[j] = src[index[j] // DIVISOR]   (DIVISOR = top_k turns a slot index into its token,
          so the top-k duplication costs no extra index tensor)
combine:  out[t] = sum_s w[t, s] * rows[row_of_slot[t, s]]   (fp32 accumulation, one pass)
combine backward: drows[row_of_slot[t, s]] = w[t, s] * dout[t] and
          dw[t, s] = <dout[t], rows[row_of_slot[t, s]]>, both from one read of dout and rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimus.ops.triton._launch import cdiv, interpreting


@triton.jit
def _gather_rows_kernel(
    src_ptr, index_ptr, out_ptr, D, stride_src, stride_out,
    DIVISOR: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    src_row = (tl.load(index_ptr + row) // DIVISOR).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    values = tl.load(src_ptr + src_row * stride_src + offs, mask=offs < D)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, values, mask=offs < D)


@triton.jit
def _combine_rows_kernel(
    rows_ptr, row_of_slot_ptr, weights_ptr, out_ptr, D, stride_rows, stride_out,
    TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        row = tl.load(row_of_slot_ptr + token * TOP_K + slot).to(tl.int64)
        values = tl.load(rows_ptr + row * stride_rows + offs, mask=offs < D, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            values *= tl.load(weights_ptr + token * TOP_K + slot).to(tl.float32)
        acc += values
    tl.store(out_ptr + token * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < D)


@triton.jit
def _combine_backward_kernel(
    dout_ptr, rows_ptr, row_of_slot_ptr, weights_ptr, drows_ptr, dweights_ptr,
    D, stride_dout, stride_rows, stride_drows,
    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    token = slot // TOP_K
    row = tl.load(row_of_slot_ptr + slot).to(tl.int64)
    weight = tl.load(weights_ptr + slot).to(tl.float32)
    dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        grad = tl.load(dout_ptr + token * stride_dout + offs, mask=offs < D, other=0.0).to(tl.float32)
        value = tl.load(rows_ptr + row * stride_rows + offs, mask=offs < D, other=0.0).to(tl.float32)
        tl.store(drows_ptr + row * stride_drows + offs, (grad * weight).to(drows_ptr.dtype.element_ty), mask=offs < D)
        dot += grad * value
    tl.store(dweights_ptr + slot, tl.sum(dot, axis=0).to(dweights_ptr.dtype.element_ty))


def _unit_stride_rows(matrix: torch.Tensor) -> torch.Tensor:
    # the kernels index rows by stride and columns by position
    return matrix if matrix.stride(1) == 1 else matrix.contiguous()


def _block_d(kernel, width: int) -> int:
    if interpreting(kernel):
        return 32
    return min(1024, triton.next_power_of_2(max(width, 16)))


def gather_rows(src: torch.Tensor, index: torch.Tensor, divisor: int = 1) -> torch.Tensor:
    """out[j] = src[index[j] // divisor]: [len(index), D]."""
    src = _unit_stride_rows(src)
    out = src.new_empty(index.numel(), src.shape[1])
    if out.numel() == 0:
        return out
    block = _block_d(_gather_rows_kernel, src.shape[1])
    grid = (index.numel(), cdiv(src.shape[1], block))
    _gather_rows_kernel[grid](src, index, out, src.shape[1], src.stride(0), out.stride(0), DIVISOR=divisor, BLOCK_D=block)
    return out


def combine_rows(rows: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_s weights[t, s] * rows[row_of_slot[t, s]] (weights None: plain sum): [T, D]."""
    n_tokens, top_k = row_of_slot.shape
    out = rows.new_empty(n_tokens, rows.shape[1])
    if out.numel() == 0:
        return out
    rows, row_of_slot = _unit_stride_rows(rows), row_of_slot.contiguous()
    block = _block_d(_combine_rows_kernel, rows.shape[1])
    grid = (n_tokens, cdiv(rows.shape[1], block))
    _combine_rows_kernel[grid](
        rows, row_of_slot, weights.contiguous() if weights is not None else row_of_slot, out,
        rows.shape[1], rows.stride(0), out.stride(0),
        TOP_K=top_k, HAS_WEIGHTS=weights is not None, BLOCK_D=block,
    )
    return out


def combine_rows_backward(
    dout: torch.Tensor, rows: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the weighted combine: (drows [M, D], dweights [T, k] in weights' dtype)."""
    n_tokens, top_k = row_of_slot.shape
    drows = rows.new_empty(rows.shape)
    dweights = weights.new_empty(n_tokens, top_k)
    if n_tokens == 0:
        return drows, dweights
    dout, rows = dout.contiguous(), _unit_stride_rows(rows)
    block = _block_d(_combine_backward_kernel, min(rows.shape[1], 256))
    _combine_backward_kernel[(n_tokens * top_k,)](
        dout, rows, row_of_slot.contiguous(), weights.contiguous(), drows, dweights,
        rows.shape[1], dout.stride(0), rows.stride(0), drows.stride(0),
        TOP_K=top_k, BLOCK_D=block,
    )
    return drows, dweights
