"""Tensor + sequence parallel layouts (alone and with FSDP) against one process.

Covers the head-split attention with full-width QK-norm (ShardedRMSNorm), the column/row-split
dense MLP, MoE blocks whose experts the tp ranks split (expert_tensor_parallel.py; its own tests in
test_expert_tensor_parallel.py), and sequence-parallel norms. Tolerances are those of
tests.helpers.parity.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import check_layout, tiny_config

pytestmark = pytest.mark.distributed


def test_tp_2_dense_matches_one_process():
    check_layout(tiny_config(parallel=dict(tp=2)), world_size=2)


@pytest.mark.slow  # make test runs tp 2 x dp_shard 2 on the MoE model (below) and tp 2 alone on this dense one
def test_tp_2_dp_shard_2_dense_matches_one_process():
    check_layout(tiny_config(parallel=dict(tp=2, dp_shard=2)), world_size=4)


def test_tp_2_dp_shard_2_moe_matches_one_process():
    check_layout(tiny_config(moe=True, parallel=dict(tp=2, dp_shard=2)), world_size=4)


@pytest.mark.slow  # extra coverage beyond the required layouts; CI runs it
def test_tp_2_with_expert_parallel_2_matches_one_process():
    # experts split over ep x tp: each rank owns 2 of the 8 (dp_shard = ep = 2)
    check_layout(tiny_config(moe=True, parallel=dict(tp=2, dp_shard=2, ep=2)), world_size=4)


def _sharded_norm_matches_full_width(rank: int, world: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    from optimus.models.layers import RMSNorm
    from optimus.parallel.tensor_parallel import ShardedRMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(16)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 16, requires_grad=True)
    want = norm(x)
    want.pow(2).sum().backward()
    sharded = ShardedRMSNorm(norm, init_device_mesh("cpu", (world,)))
    x_local = x.detach()[..., rank * 8:(rank + 1) * 8].clone().requires_grad_()
    got = sharded(x_local)
    got.pow(2).sum().backward()
    torch.testing.assert_close(got, want[..., rank * 8:(rank + 1) * 8], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x_local.grad, x.grad[..., rank * 8:(rank + 1) * 8], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sharded.weight.grad.full_tensor(), norm.weight.grad, rtol=1e-5, atol=1e-6)
    return 0.0


def test_sharded_rms_norm_is_the_full_width_norm():
    run_distributed(_sharded_norm_matches_full_width, 2)


def _logits_of_odd_length_prompt(rank: int, world: int, config) -> torch.Tensor:
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model

    dims = ParallelDims(tp=world, world_size=world)
    model = build_parallel_model(config, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    with torch.no_grad():
        return model(torch.tensor([[5, 6, 7, 8, 9]])).logits  # 5 tokens: not a multiple of tp


def test_tp_2_forward_of_a_sequence_length_that_does_not_divide_tp():
    """Generation prompts have any length: sequence parallel pads them (exact for a causal model)."""
    from optimus.models.transformer import build_model

    config = tiny_config(moe=True)
    with torch.no_grad():
        want = build_model(config.model, seed=config.train.seed)(torch.tensor([[5, 6, 7, 8, 9]])).logits
    for got in run_distributed(_logits_of_odd_length_prompt, 2, config):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_torchrun_cli_trains_at_tp_2(tmp_path):
    """End to end: torchrun -> launch detection -> Trainer at tp=2 -> checkpoint -> rank-0 summary."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "optimus",
        "train", "configs/mula-tiny-moe.yaml", "--parallel.tp=2", "--train.max_steps=2", "--train.seq_len=32",
        "--train.micro_batch_size=2", "--train.global_batch_size=4", "--model.d_model=64", "--model.n_layers=2",
        "--train.eval_batches=1", f"--run.dir={tmp_path / 'run'}", "--no-progress",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("run directory:") == 1  # the summary comes from rank 0 only
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "COMMITTED").exists()


def _tp_backward_collectives(rank: int, world: int, config) -> dict:
    """All-reduces of full activations in a tp step's forward and backward, and what reduce_partial_gradients
    leaves."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from optimus.parallel.partial_grads import reduce_partial_gradients

    dims = ParallelDims(tp=world, world_size=world)
    model = build_parallel_model(config, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    ids = torch.randint(0, config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    shapes: list[tuple] = []
    original_functional, original_dist = funcol.all_reduce, dist.all_reduce

    def functional(tensor, *args, **kwargs):
        shapes.append(tuple(tensor.shape))
        return original_functional(tensor, *args, **kwargs)

    def eager(tensor, *args, **kwargs):
        shapes.append(tuple(tensor.shape))
        return original_dist(tensor, *args, **kwargs)

    funcol.all_reduce, dist.all_reduce = functional, eager
    try:
        model(ids, labels=ids).loss.backward()
        forward_backward = list(shapes)
        partial = [name for name, p in model.named_parameters()
                   if any(placement.is_partial() for placement in getattr(p.grad, "placements", ()))]
        expected = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters() if name in partial}
        shapes.clear()
        reduce_partial_gradients([p for p in model.parameters()])
    finally:
        funcol.all_reduce, dist.all_reduce = original_functional, original_dist
    for name, p in model.named_parameters():
        assert not any(placement.is_partial() for placement in p.grad.placements), name
        assert p.grad.placements == p.placements, name
        if name in expected:
            torch.testing.assert_close(p.grad.full_tensor(), expected[name], rtol=0, atol=0)
    return {"full_activation_all_reduces": sum(1 for s in forward_backward if s[-1:] == (config.model.d_model,)),
            "partial": len(partial), "reductions_after": len(shapes)}


def test_tp_backward_reduces_each_input_gradient_once_and_the_norms_together():
    """q, k and v (gate and up) share their gathered input: its gradient is summed locally and reduce-scattered
    once per module, never all-reduced per projection; the sequence-parallel norms' Partial weight gradients are
    summed in one all-reduce before the clipping and the optimizer read them, to the same values."""
    out = run_distributed(_tp_backward_collectives, 2, tiny_config(parallel=dict(tp=2)))
    for rank in out:
        assert rank["full_activation_all_reduces"] == 0
        assert rank["partial"] >= 3 and rank["reductions_after"] == 1  # norms of 2 blocks + the final one


def _reduced_partial_gradients(rank: int, world: int) -> dict:
    """Two parameters on a 2-D (1, world) mesh, Partial over its second dim: one Replicate there (summed flattened
    with the others like it), one Shard(0) there (redistributed: each rank keeps its rows of the sum). Every rank's
    partial gradient is (rank + 1) x base. The gradients after reduce_partial_gradients: placements, this rank's
    part and the whole."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from optimus.parallel.partial_grads import reduce_partial_gradients

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    base = torch.arange(12.0).view(4, 3)
    params = {kind: nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Replicate(), placement]))
              for kind, placement in (("replicated", Replicate()), ("sharded", Shard(0)))}
    for param in params.values():
        param.grad = DTensor.from_local(base * (rank + 1), mesh, [Replicate(), Partial()], shape=(4, 3), stride=(3, 1))
    reduce_partial_gradients(list(params.values()))
    return {kind: (tuple(p.grad.placements) == tuple(p.placements), p.grad.to_local().clone(), p.grad.full_tensor())
            for kind, p in params.items()}


def test_partial_gradients_are_summed_over_the_mesh_dim_they_are_partial_on_and_placed_as_their_parameters():
    """The norms' gradients are Partial over tp on a 1-D mesh in the layouts above; here the general case
    reduce_partial_gradients states: Partial on a mesh's second dim, and a parameter sharded there (not summed
    flattened with the replicated ones: redistributed, so each rank keeps its own rows of the sum)."""
    base = torch.arange(12.0).view(4, 3)
    want = base * sum(r + 1 for r in range(2))  # the ranks' partial gradients, summed
    for rank, out in enumerate(run_distributed(_reduced_partial_gradients, 2)):
        for kind, (placed, local, whole) in out.items():
            assert placed, kind
            assert torch.equal(whole, want), kind  # small integers: exact in fp32
        assert torch.equal(out["replicated"][1], want)
        assert torch.equal(out["sharded"][1], want[2 * rank:2 * rank + 2])
