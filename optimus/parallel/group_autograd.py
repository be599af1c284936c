"""Autograd-aware sums over a process group, shared by the TP pieces (experts, vocabulary head).

Which direction sums depends on who holds what: a tensor every rank holds whole but whose gradient
each rank computes only a share of needs the gradient summed (`sum_grad_over_group`); partial
outputs that every rank needs whole are summed in the forward, and their gradient is then already
the same everywhere (`sum_over_group`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from optimus.parallel.collective_ops import all_reduce_sum


class _SumGradOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; backward all-reduces (sums) the gradient over `group`."""
    return _SumGradOverGroup.apply(x, group)


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) forward over `group`; identity backward (an op op-level checkpointing can keep:
    collective_ops.py)."""
    return all_reduce_sum(x, group)
