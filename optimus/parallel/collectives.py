"""The tensor-in, tensor-out collectives under the name this torch prefers.

torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to reduce_scatter_single /
all_gather_single (same arguments) and warns on every call of the old names, which would print in
every zero1/zero2, EP and TP run; torch before the rename has only the old names, and users on
GPUs bring their own torch.

Each call looks torch.distributed's function up anew rather than binding it at import: a wrapper
installed on torch.distributed later (a collective counter, a tracer) then sees our calls too,
whatever was imported first (benchmarks/optimizer.py counted none of the zero modes' collectives when
this module had been imported before its counter was installed).
"""

from __future__ import annotations

import torch.distributed as dist


def _named(new: str, old: str):
    return getattr(dist, new, None) or getattr(dist, old)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.reduce_scatter_single (reduce_scatter_tensor before torch 2.13)."""
    return _named("reduce_scatter_single", "reduce_scatter_tensor")(output, input, op=op, group=group,
                                                                    async_op=async_op)


def all_gather_single(output, input, group=None, async_op=False):
    """torch.distributed.all_gather_single (all_gather_into_tensor before torch 2.13)."""
    return _named("all_gather_single", "all_gather_into_tensor")(output, input, group=group, async_op=async_op)
