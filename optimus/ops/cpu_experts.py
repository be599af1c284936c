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

- oneDNN, which runs the reduced-precision (bf16, fp16) matmuls on CPU, builds and caches a
  JIT kernel per GEMM shape, and an expert's row count changes every step: the bf16 tiny MoE
  built 130-370 new kernels a step (65-100 ms of its 1.1 s), and the growing cache fragmented
  the heap (large buffers' pages faulted in afresh every step). So in those dtypes each GEMM
  runs over its rows rounded up (gemm_rows: to 16, or to 1/64-1/32 of the count when larger),
  at most ~3% more expert FLOPs, and the shapes recur: no new kernels after ~10 steps. The extra rows: for a
  row-wise product, the next rows of the same buffers (later pieces overwrite what they wrote;
  buffers end in `row_slack` spare rows); for a weight gradient, which sums over rows, zeros.
  fp32 runs MKL's sgemm, which keeps nothing per shape: no rounding there.

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


ROW_BUCKET = 16
_KERNEL_PER_SHAPE = (torch.bfloat16, torch.float16)  # the dtypes oneDNN computes here (see the module's docstring)


def _row_step(rows: int) -> int:
    return max(ROW_BUCKET, 1 << max(0, rows.bit_length() - 6))  # 1/32 to 1/64 of the count, at least ROW_BUCKET


def gemm_rows(rows: int, dtype: torch.dtype) -> int:
    """The rows an expert GEMM of `rows` rows runs over: rounded up where oneDNN builds a kernel per shape."""
    if dtype not in _KERNEL_PER_SHAPE:
        return rows
    step = _row_step(rows)
    return -(-rows // step) * step


def row_slack(step: int, dtype: torch.dtype) -> int:
    """Spare rows at the end of a chunk's buffers: enough for any piece of up to `step` rows to round up."""
    return _row_step(step) if dtype in _KERNEL_PER_SHAPE else 0


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


def _rounded(pieces, dtype: torch.dtype):
    """A chunk's pieces as (expert, lo, hi, end, is_expert_start): `end` where its rounded GEMM rows stop."""
    return [(expert, lo, hi, lo + gemm_rows(hi - lo, dtype), start) for expert, lo, hi, start in pieces]


def _gather_rows(source: torch.Tensor, index: torch.Tensor, slack: int) -> torch.Tensor:
    """source's rows at `index`, then `slack` zero rows."""
    if not slack:
        return source.index_select(0, index)
    out = source.new_empty(index.numel() + slack, source.shape[1])
    torch.index_select(source, 0, index, out=out[: index.numel()])
    out[index.numel():].zero_()
    return out


def _zero_padded(x: torch.Tensor, rows: int, scratch: torch.Tensor | None) -> torch.Tensor:
    """x with zero rows after it up to `rows` (written into scratch), for a product that sums over rows."""
    if rows == x.shape[0]:
        return x
    out = scratch[:rows]
    out[: x.shape[0]].copy_(x)
    out[x.shape[0]:].zero_()
    return out


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
        width, dtype = w_gate_up.shape[2] // 2, source.dtype
        n_rows, token_of_row = routing.order.numel(), routing.token_of_row
        step = chunk_rows(2 * width, dtype)
        slack = row_slack(step, dtype)
        out_rows = source.new_empty(n_rows + slack, w_down.shape[2])
        # one [M, 2F] buffer, written chunk by chunk (each chunk's slice stays in cache); it is the op's output,
        # so it has no spare rows: the last piece's rounded rows go through `edge`
        gate_up = source.new_empty(n_rows, 2 * width)
        edge = source.new_empty(gemm_rows(step, dtype), 2 * width) if slack else None
        for first, stop, pieces in plan_chunks(routing.groups, n_rows, step):
            n, pieces = stop - first, _rounded(pieces, dtype)
            rows = _gather_rows(source, token_of_row[first:stop], slack)
            h = gate_up[first:]  # rounded rows run into the next chunk's, which overwrites them
            for expert, lo, hi, end, _ in pieces:
                if end <= h.shape[0]:
                    torch.mm(rows[lo:end], w_gate_up[expert], out=h[lo:end])
                else:
                    h[lo:hi].copy_(torch.mm(rows[lo:end], w_gate_up[expert], out=edge[: end - lo])[: hi - lo])
            act = source.new_empty(n + slack, width)
            torch.ops.aten.silu.out(h[:n, :width], out=act[:n])
            act[:n].mul_(h[:n, width:])
            act[n:].zero_()
            for expert, lo, hi, end, _ in pieces:
                torch.mm(act[lo:end], w_down[expert], out=out_rows[first + lo : first + end])
        ctx.save_for_backward(source, w_gate_up, w_down, weights, gate_up)
        ctx.routing, ctx.step = routing, step
        psw = weights.to(out_rows.dtype) if weights is not None else None
        return _sum_per_token(out_rows[:n_rows], routing.row_of_slot, psw)

    @staticmethod
    def backward(ctx, grad_out):
        source, w_gate_up, w_down, weights, gate_up = ctx.saved_tensors
        routing = ctx.routing
        n_rows, token_of_row = routing.order.numel(), routing.token_of_row
        grad_out = grad_out.contiguous()
        width, dtype, step = w_gate_up.shape[2] // 2, source.dtype, ctx.step
        slack = row_slack(step, dtype)
        grad_w_gate_up, grad_w_down = _expert_grad_buffers(w_gate_up, w_down, routing.groups)
        grad_rows = source.new_empty(n_rows + slack, source.shape[1])
        if weights is not None:
            row_weights = weights.reshape(-1)[routing.order].to(source.dtype).unsqueeze(1)
            grad_row_weights = source.new_empty(n_rows)
        # zero-padded copies for the rounded weight gradients: a piece's D-wide operand, and its gate_up rows where
        # the rounding would run past gate_up's end
        padded = source.new_empty(gemm_rows(step, dtype), source.shape[1]) if slack else None
        edge = source.new_empty(gemm_rows(step, dtype), 2 * width) if slack else None

        chunks = plan_chunks(routing.groups, n_rows, step)
        for first, stop, pieces in chunks:
            n, pieces = stop - first, _rounded(pieces, dtype)
            h = gate_up[first:]  # past the chunk: the next chunk's rows, read (never written) by rounded products
            index = token_of_row[first:stop]
            rows, grad_y = _gather_rows(source, index, slack), _gather_rows(grad_out, index, slack)
            gate, up = h[:n, :width], h[:n, width:]
            silu = F.silu(gate)
            act = source.new_empty(n + slack, width)
            torch.mul(silu, up, out=act[:n])
            act[n:].zero_()
            grad_act = torch.empty_like(act)
            for expert, lo, hi, end, _ in pieces:
                torch.mm(grad_y[lo:end], w_down[expert].t(), out=grad_act[lo:end])
            if weights is not None:
                # the weight scaled the output: d/dw = <grad of the output, unscaled output>,
                # computed F wide as <grad_y @ W_down^T, act>
                torch.linalg.vecdot(grad_act[:n], act[:n], out=grad_row_weights[first:stop])
                act[:n].mul_(row_weights[first:stop])
                grad_act[:n].mul_(row_weights[first:stop])
            for expert, lo, hi, end, expert_start in pieces:
                _mm_into(grad_w_down[expert], act[lo:end].t(), _zero_padded(grad_y[lo:hi], end - lo, padded),
                         expert_start)
            # gate and up are fully read into silu and act: their halves of h take the gradient
            grad_up_product = torch.mul(grad_act[:n], up, out=act[:n])
            torch.mul(grad_act[:n], silu, out=up)
            torch.ops.aten.silu_backward.grad_input(grad_up_product, gate, grad_input=gate)
            for expert, lo, hi, end, expert_start in pieces:
                h_rows = h[lo:end] if end <= h.shape[0] else _zero_padded(h[lo:hi], end - lo, edge)
                _mm_into(grad_w_gate_up[expert], _zero_padded(rows[lo:hi], end - lo, padded).t(), h_rows,
                         expert_start)
                torch.mm(h_rows, w_gate_up[expert].t(), out=grad_rows[first + lo : first + end])

        grad_source = _sum_per_token(grad_rows[:n_rows], routing.row_of_slot, None)
        grad_weights = None
        if weights is not None:
            grad_weights = grad_row_weights[routing.row_of_slot].to(weights.dtype)
        return grad_source, grad_w_gate_up, grad_w_down, grad_weights, None
