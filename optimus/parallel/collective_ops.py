"""The collectives inside a block's forward, as differentiable torch ops, so op-level checkpointing can keep them.

    all_to_all_rows(rows, out_splits, in_splits, group)  uneven all_to_all_single of rows (EP dispatch and
                                                          combine, the routing counts); backward: the reverse
    all_gather_rows(rows, group)      [P*M, ...] = every rank's [M, ...]; backward reduce-scatters (sums)
    reduce_scatter_rows(rows, group)  this rank's [M, ...] slice of the sum of every rank's [P*M, ...];
                                      backward all-gathers
    all_reduce_sum(x, group)          the sum over the group of partial results every rank needs whole;
                                      backward: identity (each rank's gradient is already the whole one), or
                                      with sum_grad=True, where each rank uses the sum differently (QK-norm's
                                      sum of squares over its slice of heads), the gradients' sum

Why ops and not autograd Functions: torch's op-level checkpointing (`selective_ops`, parallelize.py) decides per
dispatched op what to keep. An autograd Function calling torch.distributed is invisible to it, so its replay of
the block ran every exchange again: each MoE layer's dispatch and combine a third time per micro-batch. As ops
(optimus::*), their outputs can be kept like a matmul's, as torchtitan keeps its all-to-all and reduce-scatter
outputs. Each calls torch.distributed's collective (looked up per call: collectives.py), so wrappers counting
bytes on torch.distributed still see them. The group travels as its registered name (an op's schema takes
no ProcessGroup).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from optimus.parallel.collectives import all_gather_single, reduce_scatter_single

# torch.library.define + impl, as ops/experts.py does (the custom_op decorator imports torch._dynamo)
torch.library.define("optimus::all_to_all_rows", "(Tensor rows, int[] out_splits, int[] in_splits, str group) -> Tensor")
torch.library.define("optimus::all_gather_rows", "(Tensor rows, str group) -> Tensor")
torch.library.define("optimus::reduce_scatter_rows", "(Tensor rows, str group) -> Tensor")
torch.library.define("optimus::all_reduce_sum", "(Tensor x, str group, bool sum_grad=False) -> Tensor")


def _rows_like(rows: torch.Tensor, n: int) -> torch.Tensor:
    return rows.new_empty((n,) + tuple(rows.shape[1:]))


@torch.library.impl("optimus::all_to_all_rows", "CompositeExplicitAutograd")
def _all_to_all_rows(rows, out_splits, in_splits, group):
    out = _rows_like(rows, sum(out_splits))
    dist.all_to_all_single(out, rows.contiguous(), list(out_splits), list(in_splits), group=_resolve_process_group(group))
    return out


@torch.library.impl("optimus::all_gather_rows", "CompositeExplicitAutograd")
def _all_gather_rows(rows, group):
    pg = _resolve_process_group(group)
    out = _rows_like(rows, dist.get_world_size(pg) * rows.shape[0])
    all_gather_single(out, rows.contiguous(), group=pg)
    return out


@torch.library.impl("optimus::reduce_scatter_rows", "CompositeExplicitAutograd")
def _reduce_scatter_rows(rows, group):
    pg = _resolve_process_group(group)
    out = _rows_like(rows, rows.shape[0] // dist.get_world_size(pg))
    reduce_scatter_single(out, rows.contiguous(), op=dist.ReduceOp.SUM, group=pg)
    return out


@torch.library.impl("optimus::all_reduce_sum", "CompositeExplicitAutograd")
def _all_reduce_sum(x, group, sum_grad=False):
    x = x.contiguous().clone()
    dist.all_reduce(x, group=_resolve_process_group(group))
    return x


@torch.library.register_fake("optimus::all_to_all_rows")
def _(rows, out_splits, in_splits, group):
    return _rows_like(rows, sum(out_splits))


@torch.library.register_fake("optimus::all_gather_rows")
def _(rows, group):
    return _rows_like(rows, dist.get_world_size(_resolve_process_group(group)) * rows.shape[0])


@torch.library.register_fake("optimus::reduce_scatter_rows")
def _(rows, group):
    return _rows_like(rows, rows.shape[0] // dist.get_world_size(_resolve_process_group(group)))


@torch.library.register_fake("optimus::all_reduce_sum")
def _(x, group, sum_grad=False):
    return torch.empty_like(x)


def _keep_args(ctx, inputs, output):
    ctx.args = inputs[1:]


def _all_to_all_backward(ctx, grad):
    out_splits, in_splits, group = ctx.args
    return torch.ops.optimus.all_to_all_rows(grad, in_splits, out_splits, group), None, None, None


def _all_gather_backward(ctx, grad):
    return torch.ops.optimus.reduce_scatter_rows(grad, ctx.args[0]), None


def _reduce_scatter_backward(ctx, grad):
    return torch.ops.optimus.all_gather_rows(grad, ctx.args[0]), None


def _all_reduce_backward(ctx, grad):
    group, sum_grad = ctx.args
    return (torch.ops.optimus.all_reduce_sum(grad, group) if sum_grad else grad), None, None


torch.library.register_autograd("optimus::all_to_all_rows", _all_to_all_backward, setup_context=_keep_args)
torch.library.register_autograd("optimus::all_gather_rows", _all_gather_backward, setup_context=_keep_args)
torch.library.register_autograd("optimus::reduce_scatter_rows", _reduce_scatter_backward, setup_context=_keep_args)
torch.library.register_autograd("optimus::all_reduce_sum", _all_reduce_backward, setup_context=_keep_args)


def all_to_all_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Uneven all_to_all_single of rows over `group`: send in_splits[q] rows to rank q, receive out_splits[q]."""
    return torch.ops.optimus.all_to_all_rows(rows, out_splits, in_splits, group.group_name)


def all_gather_rows(rows: torch.Tensor, group) -> torch.Tensor:
    """[P*M, ...] = every rank's [M, ...] in rank order; the gradient is reduce-scattered (summed)."""
    return torch.ops.optimus.all_gather_rows(rows, group.group_name)


def reduce_scatter_rows(rows: torch.Tensor, group) -> torch.Tensor:
    """This rank's [M, ...] slice of the sum over ranks of their [P*M, ...]; the gradient is all-gathered."""
    return torch.ops.optimus.reduce_scatter_rows(rows, group.group_name)


def all_reduce_sum(x: torch.Tensor, group, sum_grad: bool = False) -> torch.Tensor:
    """The sum over `group` of every rank's partial `x`. Backward: identity where every rank uses the sum alike (its
    gradient is the same on every rank already); with `sum_grad`, where each uses it differently, the sum of the
    ranks' gradients."""
    return torch.ops.optimus.all_reduce_sum(x, group.group_name, sum_grad)

