"""MoE blocks under tensor parallelism: the tp ranks split the experts (expert_tensor_parallel.py).

One MoE layer against one process (output, router statistics, the gradients of the input, the router
and every expert weight), with and without sequence parallelism, both moe_impl paths, and under
ep x tp; each tp rank must compute only its own experts' token copies. Then whole training runs
through the Trainer's code path (tests.helpers.parity tolerances).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from optimus.models.config import ModelConfig
from optimus.models.moe import MoE
from tests.helpers.distributed import run_distributed
from tests.helpers.ops import experts_saved_bytes
from tests.helpers.parity import GRAD_ATOL, GRAD_RTOL, check_layout, tiny_config

pytestmark = pytest.mark.distributed

TOL = dict(rtol=1e-5, atol=1e-6)
SEQ = 8


def _config(impl: str) -> ModelConfig:
    return ModelConfig(d_model=32, n_layers=1, n_heads=4, vocab_size=128, n_experts=8, top_k=2, expert_ffn_hidden=16,
                       moe_impl=impl)


def _reference(impl: str, seed: int) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    moe = MoE(_config(impl))
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.2)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, SEQ, moe.router.weight.shape[1], generator=generator)
    grad = torch.randn(x.shape, generator=generator)
    return moe, x, grad


def _objective(out: torch.Tensor, stats, grad: torch.Tensor) -> torch.Tensor:
    # the router's loss terms are in every rank's loss, as in training (each tp rank computes the whole loss)
    return (out * grad).sum() + stats.aux_loss + 0.1 * stats.z_loss


def _count_rows(experts, seen: list[int]) -> None:
    """Record the rows each call of this rank's expert MLP computes (the expert FLOPs are proportional)."""
    compute = experts._compute

    def counted(rows, counts):
        seen.append(rows.shape[0])
        return compute(rows, counts)

    experts._compute = counted


def _check_tp_layer(rank: int, world: int) -> dict:
    from optimus.parallel.expert_tensor_parallel import TensorParallelExperts, apply_expert_tensor_parallel

    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    rows_per_case = {}
    for impl in ("auto", "reference"):
        for sequence_parallel in (True, False):
            reference, x_all, g_all = _reference(impl, seed=1)
            parallel = copy.deepcopy(reference)
            apply_expert_tensor_parallel(parallel, tp_mesh, sequence_parallel)
            assert isinstance(parallel.experts, TensorParallelExperts)
            seen: list[int] = []
            _count_rows(parallel.experts, seen)

            x_ref = x_all.clone().requires_grad_()
            out_ref, stats_ref = reference(x_ref)
            _objective(out_ref, stats_ref, g_all).backward()

            shard = slice(rank * SEQ // world, (rank + 1) * SEQ // world) if sequence_parallel else slice(None)
            x = x_all[:, shard].clone().requires_grad_()
            out, stats = parallel(x)
            _objective(out, stats, g_all[:, shard]).backward()

            torch.testing.assert_close(out, out_ref[:, shard], **TOL)
            torch.testing.assert_close(x.grad, x_ref.grad[:, shard], **TOL)
            # router statistics: the single-process ones, on every tp rank
            assert torch.equal(stats.expert_counts, stats_ref.expert_counts)
            torch.testing.assert_close(stats.aux_loss, stats_ref.aux_loss, rtol=0, atol=0)
            torch.testing.assert_close(stats.z_loss, stats_ref.z_loss, rtol=0, atol=0)
            torch.testing.assert_close(parallel.router.weight.grad, reference.router.weight.grad, **TOL)
            n_local = reference.n_experts // world
            for name in ("w_gate_up", "w_down"):
                weight = getattr(parallel.experts, name)
                assert weight.shape == getattr(reference.experts, name).shape  # full single-device shape
                want = getattr(reference.experts, name).grad[rank * n_local:(rank + 1) * n_local]
                torch.testing.assert_close(weight.grad.to_local(), want, rtol=GRAD_RTOL, atol=GRAD_ATOL)
            # this rank computed exactly the token copies routed to its own experts
            mine = stats_ref.expert_counts[rank * n_local:(rank + 1) * n_local].sum().item()
            assert seen == [mine], (seen, mine)
            rows_per_case[(impl, sequence_parallel)] = mine
    return rows_per_case


def test_tp_2_moe_layer_matches_one_process_and_splits_the_expert_work():
    results = run_distributed(_check_tp_layer, 2)
    copies = 2 * SEQ * _config("auto").top_k  # token copies of the whole batch
    for case in results[0]:
        per_rank = [result[case] for result in results]
        assert sum(per_rank) == copies, (case, per_rank)  # every copy computed once, on one tp rank
        assert all(rows < copies for rows in per_rank), (case, per_rank)  # no rank computes all of them


def _saved_rows_bytes(rank: int, world: int) -> dict:
    """Bytes autograd saves for one forward of the tp-split experts (parameters aside), every expert given the same
    token copies, beside what activation_split's t > 1 expert term counts: the rank's rows (w k h / t), their
    gate/up (2 w k fe / t) and their output, the combine's input (w k h / t)."""
    from optimus.parallel.expert_tensor_parallel import apply_expert_tensor_parallel

    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    moe, _, _ = _reference("auto", seed=1)
    apply_expert_tensor_parallel(moe, tp_mesh, sequence_parallel=False)
    experts, config = moe.experts, _config("auto")
    tokens, k, h, fe = 64, config.top_k, config.d_model, config.expert_ffn_hidden
    saved = experts_saved_bytes(experts, tokens, h, k, config.n_experts)
    w = 4
    return {"saved": saved, "formula": tokens * w * k * (2 * h + 2 * fe) / world}


def test_tp_experts_keep_their_own_rows_not_all_the_sorted_copies():
    """The expert op keeps its input rows for the backward, and the combine its input: given a slice of all T k
    sorted copies the one kept them all, and the combine kept all T k rows, the other ranks' as zeros (each w k h
    per token and layer, not w k h / tp: tp 2 at seq 2,048, 32 MiB a layer). Both keep the rank's own rows now."""
    for result in run_distributed(_saved_rows_bytes, 2):
        assert result["saved"] == pytest.approx(result["formula"], rel=0.05), result


def _check_ep_tp_layer(rank: int, world: int, dispatch: str) -> None:
    from optimus.parallel.expert_parallel import apply_expert_parallel
    from optimus.parallel.expert_tensor_parallel import apply_expert_tensor_parallel

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "tp"))
    ep, tp = mesh["ep"].size(), mesh["tp"].size()
    ep_rank, tp_rank = mesh["ep"].get_local_rank(), mesh["tp"].get_local_rank()
    reference, x_all, g_all = _reference("auto", seed=2)  # [2, SEQ, D]: sample i belongs to ep rank i
    parallel = copy.deepcopy(reference)
    apply_expert_tensor_parallel(parallel, mesh["tp"], sequence_parallel=True)
    apply_expert_parallel(parallel, mesh["ep"], dispatch)
    seen: list[int] = []
    _count_rows(parallel.experts, seen)

    x_ref = x_all.clone().requires_grad_()
    out_ref, _ = reference(x_ref)
    (out_ref * g_all).sum().backward()

    sample, shard = slice(ep_rank, ep_rank + 1), slice(tp_rank * SEQ // tp, (tp_rank + 1) * SEQ // tp)
    x = x_all[sample, shard].clone().requires_grad_()
    out, stats = parallel(x)
    (out * g_all[sample, shard]).sum().backward()

    torch.testing.assert_close(out, out_ref[sample, shard], **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad[sample, shard], **TOL)
    router_grad = parallel.router.weight.grad.clone()
    dist.all_reduce(router_grad, group=mesh["ep"].get_group())  # each ep rank saw its own tokens
    torch.testing.assert_close(router_grad, reference.router.weight.grad, **TOL)
    n_local = reference.n_experts // (ep * tp)
    block = ep_rank * tp + tp_rank
    for name in ("w_gate_up", "w_down"):
        local = getattr(parallel.experts, name).grad.to_local()
        want = getattr(reference.experts, name).grad[block * n_local:(block + 1) * n_local]
        torch.testing.assert_close(local * ep, want, rtol=GRAD_RTOL, atol=GRAD_ATOL)  # 1/ep: expert_parallel's rule
    # the rows of this rank's expert block from both ep ranks' tokens, and nothing else
    with torch.no_grad():
        _, _, _, top_ids = reference.router(x_all.reshape(-1, x_all.shape[-1]))
    assert seen == [int(((top_ids // n_local) == block).sum())]


@pytest.mark.parametrize("dispatch", ["all_to_all", pytest.param("allgather", marks=pytest.mark.slow)])
def test_ep_2_x_tp_2_moe_layer_matches_one_process(dispatch):
    run_distributed(_check_ep_tp_layer, 4, dispatch)


# --- whole training runs: the losses and the step-1 gradients of every parameter ---
@pytest.mark.slow  # make test runs tp=2 x dp_shard=2 MoE (test_tensor_parallel.py) and the run below
def test_tp_2_moe_model_matches_one_process():
    check_layout(tiny_config(moe=True, parallel=dict(tp=2)), world_size=2)


def test_tp_2_moe_with_recomputed_moe_reference_experts_and_zero2_matches_and_resumes_at_tp_1(tmp_path):
    """Steps 1-2 at tp=2 (zero2, selective recompute of the MoE, the reference expert loop) match one
    process, losses, the clipping norms and every gradient; their DCP checkpoint then resumes in one process (tp=1)."""
    from tests.helpers.parity import (
        LOSS_RTOL_LATER_STEPS,
        CheckpointPlan,
        RunRecord,
        assert_parity,
        merge_rank_records,
        reference_run,
        run_parallel_rank,
        run_single_process,
    )

    config = tiny_config(moe=True, model=dict(moe_impl="reference"), parallel=dict(tp=2, shard_mode="zero2"),
                         train=dict(activation_checkpointing="selective", recompute=["moe"]))
    reference = reference_run(config, 3)
    save = CheckpointPlan(str(tmp_path), save=True)
    saved = merge_rank_records(run_distributed(run_parallel_rank, 2, config, 2, save))
    assert_parity(RunRecord(losses=reference.losses[:2], grad_norms=reference.grad_norms[:2], grads=reference.grads),
                  saved)
    one_process = config.model_copy(update={"parallel": type(config.parallel)()})
    resumed = run_single_process(one_process, 3, CheckpointPlan(str(tmp_path), load_step=2))
    assert resumed.losses[0] == pytest.approx(reference.losses[2], rel=LOSS_RTOL_LATER_STEPS)


@pytest.mark.slow  # extra layouts beyond the required ones
@pytest.mark.parametrize("parallel, train", [
    (dict(tp=2, dp_shard=2, ep=2, ep_dispatch="allgather", shard_mode="zero1"), {}),
    (dict(tp=2, dp_replicate=2), {}),
    (dict(tp=2, pp=2, pp_schedule="1f1b"), {}),
    (dict(tp=2), dict(activation_checkpointing="selective_ops")),
    (dict(tp=2), dict(activation_checkpointing="full")),
], ids=["ep2-allgather-zero1", "hsdp", "pp2", "ops-checkpointing", "full-checkpointing"])
def test_tp_2_moe_extra_layouts_match_one_process(parallel, train):
    world = 2 * parallel.get("dp_shard", 1) * parallel.get("dp_replicate", 1) * parallel.get("pp", 1)
    config = tiny_config(moe=True, model=dict(n_layers=4), parallel=parallel, train=train)
    check_layout(config, world_size=world, steps=3)
