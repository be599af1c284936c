"""Token permutation for dropless MoE: gather token copies into expert order, and back.

permute_tokens   x [T, D] -> rows [T*k, D] sorted by expert (each token copied once per slot), or only the
                 first groups' rows (the experts a tensor-parallel rank computes)
unpermute_tokens rows -> [T, D], the router-weighted sum of each token's k rows (the combine); rows missing at
                 the end of the sorted order count as zero (computed on another rank)

Both are differentiable (x, rows, and the router weights). The fast versions never build the
zero-filled [T*k, D] buffers that autograd of index_select / index_copy would: the gradient of
the gather is a combine (a k-row sum per token) and the gradient of the combine is a gather.
`gather_rows`, `combine_rows` and `combine_rows_backward` are the primitives, also used by the
fused expert path; backend "torch" or "triton".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optimus.ops._device import check_impl, triton_runs_on
from optimus.ops.routing import Routing, count_per_expert


def permute_tokens_reference(
    x: torch.Tensor, expert_ids: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ground truth for permute_tokens with plain autograd."""
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = count_per_expert(flat_ids, n_experts)
    return x.index_select(0, order // top_k), order, counts


def unpermute_tokens_reference(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Ground truth for unpermute_tokens with plain autograd."""
    n_tokens, top_k = weights.shape
    if rows.shape[0] < order.numel():  # the sorted rows not given are zero
        rows = torch.cat([rows, rows.new_zeros(order.numel() - rows.shape[0], rows.shape[1])])
    unsorted = torch.empty_like(rows).index_copy_(0, order, rows)
    unsorted = unsorted.view(n_tokens, top_k, -1) * weights.unsqueeze(-1).to(rows.dtype)
    return unsorted.sum(dim=1)


def gather_rows(src: torch.Tensor, index: torch.Tensor, divisor: int = 1, backend: str = "torch") -> torch.Tensor:
    """No-autograd gather: out[j] = src[index[j] // divisor]."""
    if backend == "triton":
        from optimus.ops.triton.permute import gather_rows as triton_gather

        return triton_gather(src, index, divisor)
    if divisor != 1:
        index = torch.div(index, divisor, rounding_mode="floor")
    return src.index_select(0, index)


def combine_rows(
    rows: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor | None = None, backend: str = "torch"
) -> torch.Tensor:
    """No-autograd combine: out[t] = sum_s weights[t, s] * rows[row_of_slot[t, s]] -> [T, D]."""
    if backend == "triton":
        from optimus.ops.triton.permute import combine_rows as triton_combine

        return triton_combine(rows, row_of_slot, weights)
    if weights is not None:
        weights = weights.to(rows.dtype)
    # embedding_bag is a fused gather + weighted bag sum: one read of rows, no [T, k, D] temporary
    return F.embedding_bag(row_of_slot, rows.contiguous(), mode="sum", per_sample_weights=weights)


def combine_rows_backward(
    dout: torch.Tensor, rows: torch.Tensor, routing: Routing, weights: torch.Tensor, backend: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the weighted combine: (d rows [M, D], d weights [T, k])."""
    if backend == "triton":
        from optimus.ops.triton.permute import combine_rows_backward as triton_backward

        return triton_backward(dout, rows, routing.row_of_slot, weights)
    grad_rows = dout.index_select(0, routing.token_of_row)
    grad_weights = row_dots(grad_rows, rows).to(weights.dtype)[routing.row_of_slot]
    row_weights = weights.reshape(-1)[routing.order].to(rows.dtype)
    return grad_rows.mul_(row_weights.unsqueeze(1)), grad_weights


# rows per vecdot: its [rows, D] product stays in cache (one vecdot over 65,536 x 256 rows wrote the whole product
# first: 58 ms fp32 and 45 ms bf16 on one core of a 2-core EPYC, 9 and 7 ms in chunks of 1,024; the same values)
ROW_DOT_CHUNK = 1024


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M] dot products of the rows of a and b ([M, D] each), as torch.linalg.vecdot, on a CPU a chunk of rows at a
    time (an accelerator streams the product either way: one launch)."""
    if a.device.type != "cpu":
        return torch.linalg.vecdot(a, b)
    out = a.new_empty(a.shape[0])
    for start in range(0, a.shape[0], ROW_DOT_CHUNK):
        stop = start + ROW_DOT_CHUNK
        torch.linalg.vecdot(a[start:stop], b[start:stop], out=out[start:stop])
    return out


def _kept_slots(routing: Routing, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a combine over the first n_rows sorted rows only: (each slot's row, or 0 where its row is not kept;
    whether it is kept), both [T, k]."""
    kept = routing.row_of_slot < n_rows
    return torch.where(kept, routing.row_of_slot, 0), kept


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, routing: Routing, backend: str, n_rows: int) -> torch.Tensor:
        ctx.routing, ctx.backend = routing, backend
        return gather_rows(x, routing.order[:n_rows], routing.top_k, backend)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        routing, n_rows = ctx.routing, grad_rows.shape[0]
        if n_rows == routing.order.numel():
            return combine_rows(grad_rows, routing.row_of_slot, None, ctx.backend), None, None, None
        if n_rows == 0:
            return grad_rows.new_zeros(routing.n_tokens, grad_rows.shape[1]), None, None, None
        # the rows not gathered take no gradient: their slots add a zero-weighted row
        slots, kept = _kept_slots(routing, n_rows)
        return combine_rows(grad_rows, slots, kept.to(grad_rows.dtype), ctx.backend), None, None, None


class _UnpermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, routing: Routing, backend: str) -> torch.Tensor:
        ctx.save_for_backward(rows, weights)
        ctx.routing, ctx.backend = routing, backend
        if rows.shape[0] == routing.order.numel():
            return combine_rows(rows, routing.row_of_slot, weights, backend)
        if rows.shape[0] == 0:
            return rows.new_zeros(routing.n_tokens, rows.shape[1])
        # the rows not given are zero: their slots read row 0 with weight 0 (no zero-padded [T k, D] buffer; a
        # non-finite row 0 would spread, where the step is already lost to its own tokens' non-finite output)
        slots, kept = _kept_slots(routing, rows.shape[0])
        return combine_rows(rows, slots, torch.where(kept, weights, 0), backend)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        rows, weights = ctx.saved_tensors
        routing, grad_out = ctx.routing, grad_out.contiguous()
        if rows.shape[0] == routing.order.numel():
            grad_rows, grad_weights = combine_rows_backward(grad_out, rows, routing, weights, ctx.backend)
            return grad_rows, grad_weights, None, None
        return (*_kept_rows_backward(grad_out, rows, routing, weights), None, None)


def _kept_rows_backward(dout: torch.Tensor, rows: torch.Tensor, routing: Routing,
                        weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """combine_rows_backward where only the first rows.shape[0] sorted rows were given (the rest zero): their
    gradients, and the weights' (zero for the slots of rows not given). Plain torch on every device."""
    n_rows = rows.shape[0]
    grad_rows = dout.index_select(0, routing.token_of_row[:n_rows])
    slots, kept = _kept_slots(routing, n_rows)
    dots = row_dots(grad_rows, rows).to(weights.dtype)
    grad_weights = torch.where(kept, dots[slots], 0) if n_rows else torch.zeros_like(weights)
    row_weights = weights.reshape(-1)[routing.order[:n_rows]].to(rows.dtype)
    return grad_rows.mul_(row_weights.unsqueeze(1)), grad_weights


def _backend(impl: str, tensor: torch.Tensor) -> str:
    check_impl(impl)
    if impl == "auto":
        return "triton" if triton_runs_on(tensor.device) else "torch"
    return impl


def permute_tokens(
    x: torch.Tensor, expert_ids: torch.Tensor, n_experts: int, impl: str = "auto", groups_kept: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, D]; expert_ids: [T, k] -> (rows [T*k, D] sorted by expert, order [T*k], counts [E]).

    `order[j]` is the flat (token * k + slot) index of sorted row j; ties keep token order.
    groups_kept: only the rows of experts 0 .. groups_kept - 1 are gathered (rows [sum of their counts, D]: a host
    read of the counts, a device sync on accelerators); order and counts still cover every row.
    impl: "auto", "reference", "torch" or "triton".
    """
    backend = _backend(impl, x)
    if backend == "reference":
        rows, order, counts = permute_tokens_reference(x, expert_ids, n_experts)
        return (rows if groups_kept is None else rows[: sum(counts.tolist()[:groups_kept])]), order, counts
    routing = Routing.from_expert_ids(expert_ids, n_experts)
    n_rows = routing.order.numel() if groups_kept is None else sum(routing.groups.host[:groups_kept])
    return _PermuteTokens.apply(x, routing, backend, n_rows), routing.order, routing.groups.counts


def unpermute_tokens(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Inverse of permute_tokens with the router-weight combine: -> [T, D] = sum_k w[t, k] * row.

    rows may be only the first sorted rows (permute_tokens' groups_kept): the others count as zero, and their
    slots' weights get no gradient here. Differentiable in rows and weights. impl: "auto", "reference", "torch" or
    "triton".
    """
    backend = _backend(impl, rows)
    if backend == "reference":
        return unpermute_tokens_reference(rows, order, weights)
    if rows.shape[0] > order.numel():
        raise ValueError(f"{rows.shape[0]} rows for {order.numel()} sorted slots")
    routing = Routing(order, None, weights.shape[1])
    return _UnpermuteTokens.apply(rows, weights, routing, backend)
