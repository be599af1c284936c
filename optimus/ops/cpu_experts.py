"""The expert MLP on CPU: the whole chain runs chunk by chunk over the expert-sorted rows.

On a 2-core CPU the GEMMs dominate, and one BLAS call per expert already runs near the dense
matmul rate (measured: a batched GEMM over same-sized experts gains nothing when the machine is
quiet, and loses when the batch does not split evenly over the threads). What else separates a
fast expert layer from a slow one was measured here (torch 2.13, AMD EPYC, 2 threads):
- glibc serves every allocation over 32 MB straight from mmap and unmaps it on free, so each
  step page-faults such a buffer in again at ~1 GB/s, costing more than the SwiGLU over it.
  Temporaries therefore live per chunk of rows (a few MB, recycled by the heap); only the down
  output and its gradient are [T*k, D] buffers.
- Every op over a small block is an OpenMP region, and when another process holds a core each
  region waits for it. So elementwise ops and gathers run once per chunk (spanning several
  experts, the rows being sorted by expert); only the GEMMs run per expert piece of a chunk.
- The per-token combine is one embedding_bag: a row-wise fused gather + weighted sum with fp32
  accumulation. index_add_ runs as a column-wise scatter_add_ here, several times slower.

Per chunk: gather the token rows -> gate_up GEMM per expert piece -> SwiGLU -> down GEMM per
piece. Only the gate_up output is kept for backward; backward writes its gradient over it in
place, re-gathers the rows and recomputes the activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optimus.ops.routing import Groups, Routing

# Rows per chunk are chosen so that a chunk's gate_up output is about this big.
CHUNK_BYTES = 8 << 20
MIN_CHUNK_ROWS = 64


def chunk_rows(row_width: int, dtype: torch.dtype) -> int:
    """Rows per chunk so that one [rows, row_width] temporary is about CHUNK_BYTES."""
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // max(1, row_width * torch.finfo(dtype).bits // 8))


def plan_chunks(groups: Groups, n_rows: int, step: int):
    """(first_row, stop_row, pieces) per chunk of `step` rows; a piece is one expert's part of
    the chunk: (expert, start, stop, is_expert_start), rows relative to the chunk."""
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
                break  # the expert goes on in the next chunk
            span += 1
        yield first, stop, pieces


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool) -> None:
    # an expert cut by a chunk boundary sums its weight gradient in place
    if overwrite:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def _expert_grad_buffers(w_gate_up, w_down, groups: Groups):
    # torch.empty: experts that received rows overwrite their slices, only idle ones need zeros
    grad_w_gate_up, grad_w_down = torch.empty_like(w_gate_up), torch.empty_like(w_down)
    for expert, count in enumerate(groups.host):
        if not count:
            grad_w_gate_up[expert].zero_()
            grad_w_down[expert].zero_()
    return grad_w_gate_up, grad_w_down


def _sum_per_token(rows: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    # fused gather + (weighted) bag sum, fp32 accumulation, one rounding
    return F.embedding_bag(row_of_slot, rows, mode="sum", per_sample_weights=weights)


class CpuExpertMLP(torch.autograd.Function):
    """Expert MLP (gate_up GEMM, SwiGLU, down GEMM) over routed rows, chunk by chunk.

    Sorted row j is a copy of source[routing.token_of_row[j]]; the output is
    sum_s weights[t, s] * (expert output of slot s of output row t), [T, D] (weights None: a
    plain sum, as expert_mlp uses with one slot per row).
    """

    @staticmethod
    def forward(ctx, source, w_gate_up, w_down, weights, routing: Routing):
        width = w_gate_up.shape[2] // 2
        n_rows, token_of_row = routing.order.numel(), routing.token_of_row
        out_rows = source.new_empty(n_rows, w_down.shape[2])
        step = chunk_rows(2 * width, source.dtype)
        # one [M, 2F] buffer, written chunk by chunk (each chunk's slice stays in cache)
        gate_up = source.new_empty(n_rows, 2 * width)
        for first, stop, pieces in plan_chunks(routing.groups, n_rows, step):
            rows = source.index_select(0, token_of_row[first:stop])
            h = gate_up[first:stop]
            for expert, lo, hi, _ in pieces:
                torch.mm(rows[lo:hi], w_gate_up[expert], out=h[lo:hi])
            act = F.silu(h[:, :width]).mul_(h[:, width:])
            for expert, lo, hi, _ in pieces:
                torch.mm(act[lo:hi], w_down[expert], out=out_rows[first + lo : first + hi])
        ctx.save_for_backward(source, w_gate_up, w_down, weights, gate_up)
        ctx.routing, ctx.step = routing, step
        psw = weights.to(out_rows.dtype) if weights is not None else None
        return _sum_per_token(out_rows, routing.row_of_slot, psw)

    @staticmethod
    def backward(ctx, grad_out):
        source, w_gate_up, w_down, weights, gate_up = ctx.saved_tensors
        routing = ctx.routing
        n_rows, token_of_row = routing.order.numel(), routing.token_of_row
        grad_out = grad_out.contiguous()
        width = w_gate_up.shape[2] // 2
        grad_w_gate_up, grad_w_down = _expert_grad_buffers(w_gate_up, w_down, routing.groups)
        grad_rows = source.new_empty(n_rows, source.shape[1])
        if weights is not None:
            row_weights = weights.reshape(-1)[routing.order].to(source.dtype).unsqueeze(1)
            grad_row_weights = source.new_empty(n_rows)

        chunks = plan_chunks(routing.groups, n_rows, ctx.step)
        for first, stop, pieces in chunks:
            h = gate_up[first:stop]
            index = token_of_row[first:stop]
            rows, grad_y = source.index_select(0, index), grad_out.index_select(0, index)
            gate, up = h[:, :width], h[:, width:]
            silu = F.silu(gate)
            act = silu * up
            grad_act = torch.empty_like(act)
            for expert, lo, hi, _ in pieces:
                torch.mm(grad_y[lo:hi], w_down[expert].t(), out=grad_act[lo:hi])
            if weights is not None:
                # the weight scaled the output: d/dw = <grad of the output, unscaled output>,
                # computed F wide as <grad_y @ W_down^T, act>
                torch.linalg.vecdot(grad_act, act, out=grad_row_weights[first:stop])
                act.mul_(row_weights[first:stop])
                grad_act.mul_(row_weights[first:stop])
            for expert, lo, hi, expert_start in pieces:
                _mm_into(grad_w_down[expert], act[lo:hi].t(), grad_y[lo:hi], expert_start)
            # gate and up are fully read into silu and act: their halves of h take the gradient
            grad_up_product = torch.mul(grad_act, up, out=act)
            torch.mul(grad_act, silu, out=up)
            torch.ops.aten.silu_backward.grad_input(grad_up_product, gate, grad_input=gate)
            for expert, lo, hi, expert_start in pieces:
                _mm_into(grad_w_gate_up[expert], rows[lo:hi].t(), h[lo:hi], expert_start)
                torch.mm(h[lo:hi], w_gate_up[expert].t(), out=grad_rows[first + lo : first + hi])

        grad_source = _sum_per_token(grad_rows, routing.row_of_slot, None)
        grad_weights = None
        if weights is not None:
            grad_weights = grad_row_weights[routing.row_of_slot].to(weights.dtype)
        return grad_source, grad_w_gate_up, grad_w_down, grad_weights, None
