"""The expert MLP on CPU: the whole chain runs chunk by chunk over the expert-sorted rows.

On this kind of CPU the GEMMs run near peak whatever the algorithm; what separates a fast expert
layer from a slow one is memory traffic and, on a shared 2-core machine, the number of parallel
regions. Two measured facts shape this file:
- glibc serves every allocation over 32 MB straight from mmap and unmaps it on free, so a fresh
  [T*k, D] buffer is page-faulted in again every step at ~1 GB/s, costing more than the SwiGLU
  over it. Nothing here is [T*k, ...]-sized: rows are processed in chunks of a few MB.
- Each elementwise op over a small block is one OpenMP region; when another process holds a
  core, every region waits for it, and thousands of per-expert regions cost seconds. So the
  elementwise work and the gathers/combines run once per chunk (spanning many experts, since
  the rows are sorted by expert), and only the GEMMs run per expert piece of a chunk.

Per chunk: gather the token rows -> gate_up GEMM per expert piece -> SwiGLU -> down GEMM per
piece -> scale by the router weight (fused with the cast to the fp32 sum) -> index_add into the
tokens. Only the gate_up output is kept for backward; backward writes its gradient over it in
place, re-gathers the rows and recomputes the activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optimus.ops.routing import Groups

# Rows per chunk are chosen so that a chunk's gate_up output is about this big.
CHUNK_BYTES = 8 << 20
MIN_CHUNK_ROWS = 64


def chunk_rows(row_width: int, dtype: torch.dtype) -> int:
    """Rows per chunk so that one [rows, row_width] temporary is about CHUNK_BYTES."""
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // max(1, row_width * torch.finfo(dtype).bits // 8))


def _chunks(groups: Groups, n_rows: int, step: int):
    """(first_row, stop_row, pieces) per chunk; a piece is (expert, start, stop, is_expert_start)
    with rows relative to the chunk."""
    spans = list(groups.spans())
    span = 0
    for first in range(0, n_rows, step):
        stop = min(first + step, n_rows)
        pieces = []
        while span < len(spans) and spans[span][1] < stop:
            expert, start, end = spans[span]
            lo, hi = max(start, first), min(end, stop)
            pieces.append((expert, lo - first, hi - first, lo == start))
            if end > stop:
                break
            span += 1
        yield first, stop, pieces


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool) -> None:
    # an expert cut by a chunk boundary sums its weight gradient in place
    if overwrite:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def _fp32_sum_buffer(n_rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
    # k rows per token are summed in fp32 for low-precision inputs and rounded once at the end
    dtype = torch.float32 if like.element_size() < 4 else like.dtype
    return torch.zeros(n_rows, width, dtype=dtype, device=like.device)


def _empty_expert_grads(w_gate_up, w_down, groups: Groups):
    # torch.empty: experts that received rows overwrite their slices, only idle ones need zeros
    grad_w_gate_up, grad_w_down = torch.empty_like(w_gate_up), torch.empty_like(w_down)
    for expert, count in enumerate(groups.host):
        if not count:
            grad_w_gate_up[expert].zero_()
            grad_w_down[expert].zero_()
    return grad_w_gate_up, grad_w_down


class CpuExpertMLP(torch.autograd.Function):
    """Expert MLP (gate_up GEMM, SwiGLU, down GEMM) over expert-sorted rows, chunk by chunk.

    With `token_of_row`, row j is a copy of source[token_of_row[j]] and the output is the
    per-token sum of the (row-weight scaled) expert outputs, [source rows, D]. Without it, row j
    is source[j] and the output is per row, [M, D].
    """

    @staticmethod
    def forward(ctx, source, w_gate_up, w_down, row_weights, groups, token_of_row):
        width = w_gate_up.shape[2] // 2
        combined = token_of_row is not None
        n_rows = token_of_row.numel() if combined else source.shape[0]
        if combined:
            out = _fp32_sum_buffer(source.shape[0], w_down.shape[2], source)
        else:
            out = source.new_empty(n_rows, w_down.shape[2])
        step = chunk_rows(2 * width, source.dtype)
        gate_up_chunks = []
        for first, stop, pieces in _chunks(groups, n_rows, step):
            rows = source.index_select(0, token_of_row[first:stop]) if combined else source[first:stop]
            h = rows.new_empty(stop - first, 2 * width)
            for expert, lo, hi, _ in pieces:
                torch.mm(rows[lo:hi], w_gate_up[expert], out=h[lo:hi])
            gate_up_chunks.append(h)
            act = F.silu(h[:, :width]).mul_(h[:, width:])
            y = out[first:stop] if not combined else rows.new_empty(stop - first, w_down.shape[2])
            for expert, lo, hi, _ in pieces:
                torch.mm(act[lo:hi], w_down[expert], out=y[lo:hi])
            if combined:
                if row_weights is not None:
                    # (w * act) @ W = w * (act @ W): scaling here also does the cast to the fp32 sum
                    y = torch.mul(y, row_weights[first:stop].to(out.dtype).unsqueeze(1))
                out.index_add_(0, token_of_row[first:stop], y.to(out.dtype))
        ctx.save_for_backward(source, w_gate_up, w_down, row_weights, token_of_row, *gate_up_chunks)
        ctx.groups, ctx.step, ctx.n_rows = groups, step, n_rows
        return out.to(source.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        source, w_gate_up, w_down, row_weights, token_of_row, *gate_up_chunks = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        combined = token_of_row is not None
        width = w_gate_up.shape[2] // 2
        grad_w_gate_up, grad_w_down = _empty_expert_grads(w_gate_up, w_down, ctx.groups)
        grad_source = _fp32_sum_buffer(*source.shape, source) if combined else torch.empty_like(source)
        grad_row_weights = None
        if row_weights is not None:
            grad_row_weights = source.new_empty(ctx.n_rows)

        for (first, stop, pieces), h in zip(_chunks(ctx.groups, ctx.n_rows, ctx.step), gate_up_chunks):
            if combined:
                index = token_of_row[first:stop]
                rows, grad_y = source.index_select(0, index), grad_out.index_select(0, index)
            else:
                rows, grad_y = source[first:stop], grad_out[first:stop]
            gate, up = h[:, :width], h[:, width:]
            silu = F.silu(gate)
            act = silu * up
            grad_act = torch.empty_like(act)
            for expert, lo, hi, _ in pieces:
                torch.mm(grad_y[lo:hi], w_down[expert].t(), out=grad_act[lo:hi])
            if row_weights is not None:
                scale = row_weights[first:stop].to(h.dtype).unsqueeze(1)
                torch.linalg.vecdot(grad_act, act, out=grad_row_weights[first:stop])
                act.mul_(scale)
                grad_act.mul_(scale)
            for expert, lo, hi, expert_start in pieces:
                _mm_into(grad_w_down[expert], act[lo:hi].t(), grad_y[lo:hi], expert_start)
            # gate and up are fully read into silu and act: their halves of h take the gradient
            grad_up_product = torch.mul(grad_act, up, out=act)
            torch.mul(grad_act, silu, out=up)
            torch.ops.aten.silu_backward.grad_input(grad_up_product, gate, grad_input=gate)
            grad_rows = grad_y if combined else grad_source[first:stop]
            for expert, lo, hi, expert_start in pieces:
                _mm_into(grad_w_gate_up[expert], rows[lo:hi].t(), h[lo:hi], expert_start)
                # grad_y[lo:hi] is spent (both uses above), so its rows take the row gradient
                torch.mm(h[lo:hi], w_gate_up[expert].t(), out=grad_rows[lo:hi])
            if combined:
                grad_source.index_add_(0, index, grad_rows.to(grad_source.dtype))

        if grad_row_weights is not None:
            grad_row_weights = grad_row_weights.to(row_weights.dtype)
        return grad_source.to(source.dtype), grad_w_gate_up, grad_w_down, grad_row_weights, None, None
