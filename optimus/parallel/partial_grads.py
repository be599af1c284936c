"""Gradients that DTensor leaves as unreduced partial sums, summed together once.

Under sequence parallelism (parallel/tensor_parallel.py) the norms' replicated weights see only their rank's
tokens, so their gradients come out of the backward as Partial DTensors over tp. Whoever reads one first (the
gradient clipping's norm, the optimizer, the sharded optimizer's packing) would all-reduce it on its own, a
collective's latency each, per reader: the clipping and the optimizer step read each one (twice a step).
Under FSDP its post-backward reads each one first, in every micro-batch (one all-reduce a norm weight: what
plan/block_collectives.norm_gradient_reduces prices).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def reduce_partial_gradients(params: list[nn.Parameter]) -> None:
    """Sum the gradients DTensor left unreduced (Partial) in one all-reduce per mesh dim, dtype and placements,
    and store them as their parameters are placed (18 all-reduces a step of the tiny dense model at tp 2 became
    one; Megatron-LM all-reduces its sequence-parallel norms' gradients flattened together likewise). A gradient
    that is Partial where its parameter is not Replicate, or reduced other than by a sum, DTensor redistributes.
    """
    groups: dict[tuple, list[nn.Parameter]] = {}
    for param in params:
        grad = param.grad  # (a DTensor parameter's gradient is a DTensor)
        if not isinstance(grad, DTensor) or not any(placement.is_partial() for placement in grad.placements):
            continue
        summed = all(not placement.is_partial() or (getattr(placement, "reduce_op", "sum") == "sum" and
                                                   param.placements[dim].is_replicate())
                     for dim, placement in enumerate(grad.placements))
        if not summed:
            param.grad = grad.redistribute(grad.device_mesh, param.placements)
            continue
        groups.setdefault((grad.device_mesh, tuple(grad.placements), grad.dtype), []).append(param)
    for (mesh, placements, _dtype), members in groups.items():
        parts = [param.grad.to_local() for param in members]
        flat = torch.cat([part.reshape(-1) for part in parts])
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                dist.all_reduce(flat, group=mesh.get_group(dim))
        offset = 0
        for param, part in zip(members, parts):
            reduced = flat[offset:offset + part.numel()].view_as(part)
            offset += part.numel()
            param.grad = DTensor.from_local(reduced, mesh, param.placements, run_check=False,
                                            shape=param.grad.shape, stride=param.grad.stride())
