"""The device path, checked on CPU: one full training step of every layout with every tensor on a fake
accelerator (fake_device.py: FakeTensorMode + the fake process group the dry run uses).

A CPU tensor mixed into device math, or a collective carrying a host tensor (NCCL would refuse it),
fails the step. The step is the Trainer's: build_parallel_model, build_optimizer, train_step (forward,
backward, clip, optimizer step), then the checkpoint state_dicts of model and optimizer.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Shard

from fake_device import (CheckedFakeMode, fake_pipeline_peers, in_fresh_process, register_fake_device,
                         swappable_fake_parameters)
from tests.helpers.parity import tiny_config


def _fake_pg(world_size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # the fake backend for host and fake-device tensors alike (object collectives pick by device)
    dist.init_process_group("cpu:fake,fakecuda:fake", store=FakeStore(), rank=0, world_size=world_size)


def _one_step(moe: bool, parallel: dict, world_size: int, n_layers: int = 2, **train) -> CheckedFakeMode:
    """One train_step of the layout on the fake device; returns the mode (collectives, matmul dtypes)."""
    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from optimus.train.state import ModelState, OptimizerState
    from optimus.train.step import train_step

    device = register_fake_device()
    # a small vocabulary: the seeded initial weights are computed for real on the host
    config = tiny_config(moe=moe, parallel=parallel, train=train, model=dict(n_layers=n_layers, vocab_size=512))
    p = config.parallel
    dims = ParallelDims.from_config(p, world_size)
    _fake_pg(world_size)
    mesh = dims.build_mesh(device.type)
    t = config.train
    # expert counts read on the host: an even routing, so that they add up to the rows (T x top_k)
    even = t.micro_batch_size * t.seq_len * config.model.top_k // max(config.model.n_experts, 1)
    mode = CheckedFakeMode(count_value=even)
    with mode, fake_pipeline_peers(), swappable_fake_parameters(mode):
        model = build_parallel_model(config, dims, mesh, device)
        optimizer = build_optimizer(model, config.optim)
        n_micro = t.global_batch_size // (dims.dp * t.micro_batch_size)
        # the loader's batches are host tensors: train_step moves them to the device
        batches = [(torch.randint(0, 100, (t.micro_batch_size, t.seq_len)),
                    torch.randint(0, 100, (t.micro_batch_size, t.seq_len))) for _ in range(n_micro)]
        result = train_step(model, optimizer, batches, device=device, dtype=t.dtype, grad_clip=1.0,
                            dp_mesh=mesh["dp"])
        assert not result.skipped
        for name, param in model.named_parameters():
            assert param.device == device, name
            if ".experts." in name and dims.tp > 1:  # the tp ranks split the experts (expert_tensor_parallel)
                tp_dim = param.device_mesh.mesh_dim_names.index("tp")
                assert param.placements[tp_dim] == Shard(0), (name, param.placements)
            assert param.grad is None or param.grad.device == device, name
            assert param.dtype == torch.float32, name  # fp32 master weights
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    assert value.device == device
        pipeline = getattr(model, "pipeline", None)
        if pipeline is not None and len(pipeline.stages) == 1:  # evaluation sums its totals over pp too
            loss = pipeline.evaluate_loss(batches[:1], device, contextlib.nullcontext())
            assert isinstance(loss, float)
        model_sd, optim_sd = ModelState(model).state_dict(), OptimizerState(model, optimizer).state_dict()
        assert model_sd and optim_sd
        assert all(v.device == device for v in model_sd.values() if isinstance(v, torch.Tensor))
    return mode


LAYOUTS = {
    "fsdp": (False, dict(dp_shard=2), 2),
    "fsdp-moe": (True, dict(dp_shard=2), 2),
    "hsdp": (False, dict(dp_replicate=2, dp_shard=2), 4),
    "hsdp-moe": (True, dict(dp_replicate=2, dp_shard=2), 4),
    "tp-sp": (False, dict(tp=2, dp_shard=2), 4),
    "tp-sp-moe": (True, dict(tp=2, dp_shard=2), 4),
    "ep-all-to-all": (True, dict(dp_shard=2, ep=2, ep_dispatch="all_to_all"), 2),
    "ep-allgather": (True, dict(dp_shard=4, ep=2, ep_dispatch="allgather"), 4),
    "pp-gpipe": (False, dict(pp=2, pp_schedule="gpipe"), 2),
    "pp-1f1b": (False, dict(pp=2, pp_schedule="1f1b"), 2),
    "pp-interleaved-1f1b": (False, dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), 2),
    # everything at once: FSDP over dp_shard (with EP inside it), TP + SP, PP
    "fsdp-tp-pp-ep": (True, dict(dp_shard=2, tp=2, pp=2, ep=2), 8),
}


# make test keeps four that between them run every dimension, both dispatches and an interleaved pipeline (the
# last one's FSDP, TP + SP, PP and EP at once); the others, one or two dimensions each, run in make test-slow
EXTRA_LAYOUTS = ("fsdp", "fsdp-moe", "hsdp-moe", "tp-sp", "tp-sp-moe", "ep-all-to-all", "pp-gpipe", "pp-1f1b")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in EXTRA_LAYOUTS else name
                                  for name in LAYOUTS])
@in_fresh_process  # a fake process group and a registered fake backend: keep them out of this process
def test_one_training_step_on_the_fake_device(name):
    moe, parallel, world = LAYOUTS[name]
    stages = parallel.get("pp", 1) * parallel.get("pp_virtual_stages", 1)
    mode = _one_step(moe, parallel, world, n_layers=max(2, stages))
    assert mode.matmul_dtypes == {torch.float32}
    ops = {op.replace("_", "") for op, _ in mode.collectives}
    # FSDP gathers and reduce-scatters, train_step reduces the loss terms (over dp, or pp): all on the device
    if parallel.get("dp_shard", 1) > 1:
        assert any("allgather" in op for op in ops) and any("reducescatter" in op for op in ops), ops
    if parallel.get("pp", 1) > 1:
        assert {"c10d.send.default", "c10d.recv.default"} <= ops, ops  # activations and their gradients
    assert any("allreduce" in op for op in ops), ops


@pytest.mark.parametrize("moe", [pytest.param(False, marks=pytest.mark.slow), True], ids=["dense", "moe"])
@in_fresh_process
def test_bf16_autocast_step_on_the_fake_device(moe):
    """The bf16 path: matmuls in bf16 under autocast, fp32 master weights and optimizer state."""
    mode = _one_step(moe, dict(dp_shard=2), 2, dtype="bf16")
    assert torch.bfloat16 in mode.matmul_dtypes


@in_fresh_process
def test_a_host_tensor_in_a_collective_fails_the_check():
    """The check has teeth: a CPU tensor reduced as the old pipeline gathering did is refused."""
    import torch.distributed as dist

    register_fake_device()
    _fake_pg(2)
    with CheckedFakeMode():
        with pytest.raises(AssertionError, match="NCCL would refuse"):
            dist.all_reduce(torch.zeros(2, dtype=torch.float64))
        dist.all_reduce(torch.zeros(2, dtype=torch.float64, device="fakecuda:0"))


@in_fresh_process
def test_a_cpu_tensor_mixed_into_device_math_fails():
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    device = register_fake_device()
    with CheckedFakeMode():
        with pytest.raises(FakeTensorDeviceMismatchError):
            torch.ones(3, device=device) + torch.ones(3)


@in_fresh_process
def test_pipeline_loss_gathering_stays_on_the_device():
    """The pp all-reduce of the step's loss terms and expert counts carries device tensors only (a CPU
    accumulator there, as before, is what NCCL refuses)."""
    from torch.distributed.device_mesh import init_device_mesh

    from optimus.parallel.pipeline import PipelineRuntime

    device = register_fake_device()
    _fake_pg(2)
    config = tiny_config(moe=True).model
    pp_mesh = init_device_mesh(device.type, (2,), mesh_dim_names=("pp",))
    with CheckedFakeMode() as mode:
        aux, z = torch.zeros((), device=device), torch.zeros((), device=device)
        counts = torch.zeros(1, config.n_experts, dtype=torch.int64, device=device)
        stage = SimpleNamespace(layers={"1": None}, records=[(aux, z, counts)])  # this rank: layer 1 only
        runtime = PipelineRuntime(SimpleNamespace(config=config), [stage], [0], 2, pp_mesh, "gpipe", device)
        sums = runtime._gather_terms([torch.zeros((), device=device)], 1, device)
        assert {key: value.device for key, value in sums.items()} == dict.fromkeys(sums, device)
        assert sums["expert_counts"].shape == (config.n_layers, config.n_experts)
        assert [op for op, _ in mode.collectives] == ["c10d.allreduce_.default"]
