"""Gradient accumulation reduces once per step where asked (parallel.defer_grad_sync), and still equals
one process: HSDP (dp_replicate 2 x dp_shard 2), two micro-batches per rank per step."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import check_layout, tiny_config

pytestmark = pytest.mark.distributed

HSDP = dict(dp_replicate=2, dp_shard=2)


# make test: nothing deferred and everything deferred; deferring the replicate reduction alone in make test-slow
@pytest.mark.parametrize("defer", ["none", pytest.param("replicate", marks=pytest.mark.slow), "all"])
def test_hsdp_matches_one_process_whatever_is_deferred(defer):
    config = tiny_config(moe=True, parallel=dict(HSDP, defer_grad_sync=defer), train=dict(micro_batch_size=1))
    check_layout(config, world_size=4, steps=3)


def _count_gradient_collectives(rank: int, world: int, defer: str) -> dict[str, int]:
    import torch
    import torch.distributed as dist

    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from tests.helpers.parity import global_batches, rank_micro_batches
    from optimus.train.step import train_step

    config = tiny_config(parallel=dict(HSDP, defer_grad_sync=defer), train=dict(micro_batch_size=1))
    dims = ParallelDims(world_size=world, **HSDP)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, torch.device("cpu"))
    optimizer = build_optimizer(model, config.optim)
    micro = rank_micro_batches(global_batches(config, 1)[0], config.train.micro_batch_size,
                               mesh.local_rank("dp"), mesh.size("dp"))
    assert len(micro) == 2
    counts = {"all_reduce": 0, "reduce_scatter": 0}

    def counting(name, collective):
        def call(*args, **kwargs):
            counts[name] += 1
            return collective(*args, **kwargs)
        return call

    # FSDP2 calls these through the torch.distributed module; the loss average uses functional collectives
    dist.all_reduce = counting("all_reduce", dist.all_reduce)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, counting("reduce_scatter", getattr(dist, name)))
    train_step(model, optimizer, micro, device=torch.device("cpu"), dtype="fp32", dp_mesh=mesh["dp"],
               defer_grad_sync=defer)
    return counts


def test_deferred_reductions_run_once_per_step_not_once_per_micro_batch():
    counts = {defer: run_distributed(_count_gradient_collectives, 4, defer, timeout=90)[0]
              for defer in ("none", "replicate", "all")}
    every = counts["none"]
    assert every["all_reduce"] > 0 and every["reduce_scatter"] > 0
    # replicate: HSDP's all-reduce after the last micro-batch only; reduce-scatter still per micro-batch
    assert counts["replicate"] == {"all_reduce": every["all_reduce"] // 2, "reduce_scatter": every["reduce_scatter"]}
    # all: both once per step
    assert counts["all"] == {"all_reduce": every["all_reduce"] // 2, "reduce_scatter": every["reduce_scatter"] // 2}
