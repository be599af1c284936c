"""parallel.shard_mode=ddp (data_parallel.apply_ddp): torch DDP for pure data parallelism.

Against one process within the parity tolerances (tests.helpers.parity: fp32 loss rel 1e-5 at step 1,
1e-4 later; grads atol 1e-5 / rtol 1e-4) with two micro-batches per rank; gradients all-reduced once per
step under accumulation; checkpoints DCP-resharded between ddp and fsdp both ways."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import check_layout, tiny_config

pytestmark = pytest.mark.distributed

DDP2 = dict(dp_shard=2, shard_mode="ddp")


def test_ddp_dp_2_matches_one_process():
    check_layout(tiny_config(parallel=DDP2), world_size=2, steps=3)


@pytest.mark.slow  # extra coverage: an MoE model and the dp_replicate spelling of the data-parallel degree
def test_ddp_moe_dp_replicate_2_matches_one_process():
    check_layout(tiny_config(moe=True, parallel=dict(dp_replicate=2, shard_mode="ddp")), world_size=2, steps=3)


def _all_reduced_elements(rank: int, world: int, defer: str) -> dict:
    """One train_step of 2 micro-batches; the elements of every bucket DDP all-reduced (a counting comm hook)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from tests.helpers.parity import global_batches, rank_micro_batches
    from optimus.train.step import train_step

    config = tiny_config(parallel=dict(DDP2, defer_grad_sync=defer))
    dims = ParallelDims(dp_shard=2, world_size=world)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, torch.device("cpu"))
    optimizer = build_optimizer(model, config.optim)
    group, buckets = mesh["dp"].get_group(), []

    def counting(state, bucket):
        buckets.append(bucket.buffer().numel())
        return allreduce_hook(group, bucket)

    model.register_comm_hook(None, counting)
    micro = rank_micro_batches(global_batches(config, 1)[0], config.train.micro_batch_size,
                               mesh.local_rank("dp"), mesh.size("dp"))
    assert len(micro) == 2
    train_step(model, optimizer, micro, device=torch.device("cpu"), dtype="fp32", dp_mesh=mesh["dp"],
               defer_grad_sync=defer)
    # the reduced gradients are the same on every rank (the optimizer then keeps the replicas equal)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    everyone = [torch.empty_like(grads) for _ in range(world)]
    torch.distributed.all_gather(everyone, grads, group=group)
    return {"buckets": buckets, "params": sum(p.numel() for p in model.parameters()),
            "replicas_equal": all(torch.equal(everyone[0], other) for other in everyone)}


def test_ddp_all_reduces_gradients_once_per_step_under_accumulation():
    """defer_grad_sync replicate (the default) or all: no_sync on the first micro-batch, so every gradient
    element is all-reduced exactly once per step; none: once per micro-batch (twice)."""
    counts = {defer: run_distributed(_all_reduced_elements, 2, defer, timeout=90)[0] for defer in ("none", "replicate")}
    once, every = counts["replicate"], counts["none"]
    assert once["replicas_equal"] and every["replicas_equal"]
    assert sum(once["buckets"]) == once["params"]
    assert sum(every["buckets"]) == 2 * every["params"] and len(every["buckets"]) == 2 * len(once["buckets"])


def test_ddp_checkpoint_resumes_under_fsdp_and_back(tmp_path):
    """ddp dp 2 (steps 1-2) -> fsdp dp 2 (steps 3-4) -> ddp dp 2 (step 5): the loss curve is one process's."""
    from tests.helpers.parity import LOSS_RTOL_LATER_STEPS, CheckpointPlan, reference_run, run_parallel_rank

    ddp, fsdp = tiny_config(parallel=DDP2), tiny_config(parallel=dict(dp_shard=2))
    reference = reference_run(ddp, 5)
    run = str(tmp_path)
    curve = run_distributed(run_parallel_rank, 2, ddp, 2, CheckpointPlan(run, save=True))[0].losses
    curve += run_distributed(run_parallel_rank, 2, fsdp, 4, CheckpointPlan(run, load_step=2, save=True))[0].losses
    curve += run_distributed(run_parallel_rank, 2, ddp, 5, CheckpointPlan(run, load_step=4))[0].losses
    assert len(curve) == 5
    for step, (want, got) in enumerate(zip(reference.losses, curve), start=1):
        assert abs(got - want) <= LOSS_RTOL_LATER_STEPS * abs(want), (step, curve, reference.losses)
