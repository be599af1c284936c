"""Pipeline parallelism against one process: the step's loss terms (MoE aux and z included) and every
gradient, for each schedule on pp=2, dense and MoE models; then whole training runs (parity.py)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from optimus.models.config import ModelConfig
from optimus.models.transformer import build_model
from optimus.parallel.pipeline import apply_pipeline, split_layers
from tests.helpers.distributed import run_distributed
from optimus.train.evaluate import evaluate
from optimus.train.step import forward_backward

pytestmark = pytest.mark.distributed

TOL = dict(rtol=1e-5, atol=1e-6)


def _config(moe: bool) -> ModelConfig:
    extra = dict(n_experts=8, top_k=2, expert_ffn_hidden=32) if moe else dict(n_experts=0, ffn_hidden=128)
    # large aux/z coefficients so a wrong aux path shows in the gradients
    return ModelConfig(d_model=64, n_layers=4, n_heads=4, vocab_size=256, aux_loss_coef=0.5, z_loss_coef=0.1, **extra)


def _micro_batches(n: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (n, 2, 33), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _check_step(rank: int, world: int, moe: bool, schedule: str, virtual: int) -> None:
    cfg = _config(moe)
    batches = _micro_batches(4, cfg.vocab_size)
    reference = build_model(cfg, seed=0)
    want = forward_backward(reference, batches, torch.device("cpu"), "fp32")
    want_grads = {name: p.grad for name, p in reference.named_parameters()}

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    model = apply_pipeline(build_model(cfg, seed=0), mesh["pp"], schedule, virtual)
    got = model.pipeline.forward_backward(batches, torch.device("cpu"), contextlib.nullcontext())
    for key in ("loss", "ce_loss", "aux_loss", "z_loss"):
        if key in want:
            torch.testing.assert_close(got[key], want[key], **TOL, msg=f"{key}: {got} vs {want}")
    if moe:
        assert torch.equal(got["expert_counts"], want["expert_counts"])
    names = [name for name, _ in model.named_parameters()]
    assert names and set(names) < set(want_grads)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want_grads[name], **TOL, msg=name)
    # forward-only evaluation through the stages (the Trainer's held-out loss under PP)
    heldout = _micro_batches(3, cfg.vocab_size)
    want_eval = evaluate(reference, heldout, torch.device("cpu")).loss
    got_eval = model.pipeline.evaluate_loss(heldout, torch.device("cpu"), contextlib.nullcontext())
    assert abs(got_eval - want_eval) <= 1e-5 * abs(want_eval), (got_eval, want_eval)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_pipeline_step_matches_single_process(moe, schedule, virtual):
    run_distributed(_check_step, 2, moe, schedule, virtual)


def test_split_layers():
    assert split_layers(4, 2) == [["0", "1"], ["2", "3"]]
    assert split_layers(5, 4) == [["0", "1"], ["2"], ["3"], ["4"]]
    with pytest.raises(ValueError):
        split_layers(2, 4)


# --- whole training runs through the Trainer's code path (parity.py: 5 steps of losses, step-1 grads) ---
# every schedule x {dense, MoE} is covered step by step above; here the Trainer's path, 5 steps, once per schedule
@pytest.mark.parametrize("moe,schedule,virtual", [(False, "gpipe", 1), (True, "1f1b", 1), (True, "interleaved_1f1b", 2)],
                         ids=["dense-gpipe", "moe-1f1b", "moe-interleaved"])
def test_pp_layout_matches_one_process(moe, schedule, virtual):
    from tests.helpers.parity import check_layout, tiny_config

    parallel = dict(pp=2, pp_schedule=schedule, pp_virtual_stages=virtual)
    check_layout(tiny_config(moe=moe, model={"n_layers": 4}, parallel=parallel), world_size=2)


def _run_parallel_rank_recording_warnings(rank: int, world_size: int, config, steps: int):
    from tests.helpers.parity import run_parallel_rank

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = run_parallel_rank(rank, world_size, config, steps)
    return record, [str(w.message) for w in caught]


def test_pp_2_ep_2_layout_matches_one_process_without_fsdp_view_warnings():
    """FSDP over pipeline stages of a MoE: parity with one process, and no FSDP2 warning about the stage's output
    being a view (the aux-loss injection's identity; the schedule never writes it in place)."""
    from tests.helpers.parity import assert_parity, merge_rank_records, reference_run, tiny_config

    parallel = dict(pp=2, dp_shard=2, ep=2, pp_schedule="1f1b")
    config = tiny_config(moe=True, model={"n_layers": 4}, parallel=parallel)
    results = run_distributed(_run_parallel_rank_recording_warnings, 4, config, 5)
    assert_parity(reference_run(config, 5), merge_rank_records([record for record, _ in results]))
    view_warnings = [m for _, messages in results for m in messages if "returned a view tensor" in m]
    assert not view_warnings, view_warnings[0]


def test_pp_2_interleaved_with_selective_recompute_matches_one_process():
    # the stages share the model's blocks: the recomputed sub-modules are swapped in place, seen by both
    from tests.helpers.parity import check_layout, tiny_config

    parallel = dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    train = dict(activation_checkpointing="selective", recompute=["attention", "moe", "norms"])
    check_layout(tiny_config(moe=True, model={"n_layers": 4}, parallel=parallel, train=train), world_size=2, steps=3)


# make test runs tp x pp once (MoE, interleaved); the dense 1F1B pair in make test-slow
@pytest.mark.parametrize("moe,schedule,virtual", [
    pytest.param(False, "1f1b", 1, marks=pytest.mark.slow), (True, "interleaved_1f1b", 2),
], ids=["dense-1f1b", "moe-interleaved"])
def test_tp_2_pp_2_layout_matches_one_process(moe, schedule, virtual):
    from tests.helpers.parity import check_layout, tiny_config

    parallel = dict(pp=2, tp=2, pp_schedule=schedule, pp_virtual_stages=virtual)
    check_layout(tiny_config(moe=moe, model={"n_layers": 4}, parallel=parallel), world_size=4)


def test_pp_2_ep_2_checkpoint_resumes_in_one_process(tmp_path):
    """DCP keys under PP and EP are the single-process ones: a pp=2 x ep=2 checkpoint (model and
    optimizer) resumes in one process and the loss curve goes on as if never stopped."""
    from tests.helpers.parity import (
        LOSS_RTOL_LATER_STEPS, CheckpointPlan, reference_run, run_parallel_rank, run_single_process, tiny_config,
    )

    parallel = dict(pp=2, dp_shard=2, ep=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, ep_dispatch="allgather")
    before = tiny_config(moe=True, model={"n_layers": 4}, parallel=parallel)
    after = tiny_config(moe=True, model={"n_layers": 4})
    reference = reference_run(after, 4)
    saved = run_distributed(run_parallel_rank, 4, before, 2, CheckpointPlan(str(tmp_path), save=True))
    resumed = run_single_process(after, 4, CheckpointPlan(str(tmp_path), load_step=2))
    curve = saved[0].losses + resumed.losses
    assert len(curve) == 4
    for want, got in zip(reference.losses, curve):
        assert abs(got - want) <= LOSS_RTOL_LATER_STEPS * abs(want), (curve, reference.losses)


def test_pp_2_checkpoint_resumes_at_pp_2(tmp_path):
    """Each pp rank saves and reloads its own stages' optimizer state (flattened, keyed by parameter)."""
    from tests.helpers.parity import (
        LOSS_RTOL_LATER_STEPS, CheckpointPlan, reference_run, run_parallel_rank, tiny_config,
    )

    config = tiny_config(moe=True, model={"n_layers": 4}, parallel=dict(pp=2, pp_schedule="1f1b"))
    reference = reference_run(tiny_config(moe=True, model={"n_layers": 4}), 4)
    saved = run_distributed(run_parallel_rank, 2, config, 2, CheckpointPlan(str(tmp_path), save=True))
    resumed = run_distributed(run_parallel_rank, 2, config, 4, CheckpointPlan(str(tmp_path), load_step=2))
    curve = saved[0].losses + resumed[0].losses
    for want, got in zip(reference.losses, curve, strict=True):
        assert abs(got - want) <= LOSS_RTOL_LATER_STEPS * abs(want), (curve, reference.losses)
