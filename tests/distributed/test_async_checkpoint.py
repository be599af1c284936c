"""An asynchronous checkpoint of an FSDP model, written while the next step trains, loads to exactly
what a synchronous checkpoint of the same moment loads to (2 gloo ranks, dp_shard=2)."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _build(config, world: int):
    import torch

    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from optimus.train.state import ModelState, OptimizerState

    dims = ParallelDims(dp_shard=world, world_size=world)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, torch.device("cpu"))
    optimizer = build_optimizer(model, config.optim)
    return model, optimizer, mesh, {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}


def _local_tensors(state: dict) -> dict:
    """This rank's shard of every model and optimizer tensor, by checkpoint key."""
    tensors = {}
    for part, stateful in state.items():
        for key, value in stateful.state_dict().items():
            if hasattr(value, "to_local"):
                value = value.to_local()
            tensors[f"{part}.{key}"] = value.detach().clone() if hasattr(value, "detach") else value
    return tensors


def _async_and_sync_checkpoints_load_equal(rank: int, world: int, run_dir: str) -> list[str]:
    import functools

    import torch

    from optimus.checkpoint.manager import CheckpointManager
    from tests.helpers import parity

    config = parity.tiny_config(parallel=dict(dp_shard=world))
    model, optimizer, mesh, state = _build(config, world)
    micro = functools.partial(parity.rank_micro_batches, micro_batch_size=config.train.micro_batch_size,
                              dp_rank=rank, dp_size=world)
    parity.train_model(model, optimizer, config, 1, micro, mesh["dp"], keep_grads=False)
    sync, background = CheckpointManager(f"{run_dir}/sync"), CheckpointManager(f"{run_dir}/async")
    sync.save(1, state, {})
    background.save(1, state, {}, asynchronous=True)
    # FSDP's collectives on the default group run while DCP's background thread uses its own group
    parity.train_model(model, optimizer, config, 1, micro, mesh["dp"], keep_grads=False)
    assert background.finish_pending() == 1 and background.committed_steps() == [1]

    loaded = []
    for manager in (sync, background):
        _, _, _, fresh = _build(config, world)
        manager.load(1, fresh)
        loaded.append(_local_tensors(fresh))
    want, got = loaded
    assert want.keys() == got.keys() and any(key.startswith("optimizer.state.") for key in want)
    differ = [key for key in want if isinstance(want[key], torch.Tensor) and not torch.equal(want[key], got[key])]
    differ += [key for key in want if not isinstance(want[key], torch.Tensor) and want[key] != got[key]]
    trained_on = _local_tensors(state)["model.layers.0.attn.q_proj.weight"]  # a step past the saved state
    assert not torch.equal(trained_on, want["model.layers.0.attn.q_proj.weight"])
    return differ


def test_fsdp_async_checkpoint_loads_equal_to_a_sync_one(tmp_path):
    differ = run_distributed(_async_and_sync_checkpoints_load_equal, 2, str(tmp_path), timeout=120)
    assert differ == [[], []]
