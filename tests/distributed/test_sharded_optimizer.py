"""zero1 / zero2 (optim/sharded.py) against one process: losses and step-1 gradients within the parity
tolerances (tests.helpers.parity: fp32 loss rel 1e-5 at step 1, 1e-4 later; grads atol 1e-5 / rtol 1e-4),
EP-aware and EP-unaware; the per-rank optimizer-state sizes the EP-aware scheme promises; resume; the clipping norm
counting what tp ranks hold alike once (fsdp as well)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import NORM_RTOL_FIRST_STEP, check_layout, global_batches, rank_micro_batches, tiny_config
from tests.helpers.runs import small_moe_trainer_config, train_small_moe_on_rank

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("mode", ["zero1", "zero2"])
def test_dense_dp_shard_2_matches_one_process(mode):
    check_layout(tiny_config(parallel=dict(dp_shard=2, shard_mode=mode)), world_size=2, steps=3)


@pytest.mark.parametrize("mode,ep_aware", [("zero1", True), ("zero2", True), ("zero1", False), ("zero2", False)])
def test_moe_dp_2_ep_2_matches_one_process(mode, ep_aware):
    config = tiny_config(moe=True, parallel=dict(dp_shard=4, ep=2, shard_mode=mode, ep_aware=ep_aware))
    check_layout(config, world_size=4, steps=3)


def test_zero2_experts_that_do_not_divide_are_sharded_along_dim_1():
    # 6 experts: 3 per ep rank over expert_dp 2 -> expert state split along d_model (FSDP2's choice);
    # the router's 6 rows over dp 4 leave one rank an empty block
    config = tiny_config(moe=True, model={"n_experts": 6}, parallel=dict(dp_shard=4, ep=2, shard_mode="zero2"))
    check_layout(config, world_size=4, steps=3)


def test_zero1_with_pipeline_2_matches_one_process():
    parallel = dict(pp=2, dp_shard=2, shard_mode="zero1", pp_schedule="1f1b")
    check_layout(tiny_config(moe=True, model={"n_layers": 4}, parallel=parallel), world_size=4, steps=3)


@pytest.mark.slow  # extra coverage: zero2 + EP-unaware under PP 2 x EP 2
def test_zero2_ep_unaware_with_pipeline_2_and_ep_2_matches_one_process():
    parallel = dict(pp=2, dp_shard=2, ep=2, shard_mode="zero2", ep_aware=False, pp_schedule="gpipe",
                    ep_dispatch="allgather")
    check_layout(tiny_config(moe=True, model={"n_layers": 4}, parallel=parallel), world_size=4, steps=3)


def test_zero1_replicate_2_ep_2_with_selective_checkpointing_matches_one_process():
    # dp_replicate 2 x dp_shard 2 (= ep 2): state sharded over all 4 dp ranks, experts over dp_replicate
    config = tiny_config(moe=True, parallel=dict(dp_replicate=2, dp_shard=2, ep=2, shard_mode="zero1"),
                         train=dict(activation_checkpointing="selective", recompute=["moe", "norms"]))
    check_layout(config, world_size=4, steps=3)


def test_zero2_ep_2_with_full_activation_checkpointing_matches_one_process():
    config = tiny_config(moe=True, parallel=dict(dp_shard=2, ep=2, shard_mode="zero2"),
                         train=dict(activation_checkpointing="full"))
    check_layout(config, world_size=2, steps=3)


@pytest.mark.slow  # extra coverage: tensor parallel parameters (DTensors over tp) under zero1
def test_zero1_with_tp_2_matches_one_process():
    check_layout(tiny_config(parallel=dict(dp_shard=2, tp=2, shard_mode="zero1")), world_size=4, steps=3)


def _keep_only_the_norms_gradients(model) -> None:
    """Every gradient but the norms' weights (the same on every tp rank) zeroed once it is in .grad (FSDP2 runs these
    hooks on its sharded parameters after its reduce-scatter; the sharded optimizer's own, registered later, after)."""
    for name, param in model.named_parameters():
        if not name.endswith("norm.weight"):
            param.register_post_accumulate_grad_hook(_zero_the_gradient)


def _zero_the_gradient(param) -> None:
    param.grad.zero_()


def _norms_gradient_norm(rank: int, world_size: int, config) -> float:
    """(on a rank, built as run_parallel_rank builds it) the gradient norm train_step clips by, of one step whose
    only gradients are the norms'."""
    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from optimus.train.step import train_step

    dims = ParallelDims.from_config(config.parallel, world_size)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, "cpu")
    _keep_only_the_norms_gradients(model)
    micro = rank_micro_batches(global_batches(config, 1)[0], config.train.micro_batch_size,
                               dp_rank=mesh.local_rank("dp"), dp_size=mesh.size("dp"))
    return train_step(model, build_optimizer(model, config.optim), micro, device=torch.device("cpu"),
                      grad_clip=config.optim.grad_clip, dp_mesh=mesh["dp"]).grad_norm


@pytest.mark.parametrize("mode", ["zero1", "fsdp", pytest.param("zero2", marks=pytest.mark.slow)])
def test_gradients_the_same_on_every_tp_rank_are_counted_once_in_the_norm(mode):
    """The parity tests' norms are dominated by the large sharded weights: counting the norms' tiny replicated
    gradients on both tp ranks moved them by less than their 1e-4 tolerance. Here the norms' are the only
    gradients, so counting them twice is a factor of up to sqrt(2)."""
    from optimus.models.transformer import build_model
    from optimus.optim.build import build_optimizer
    from optimus.train.step import train_step

    config = tiny_config(parallel=dict(dp_shard=2, tp=2, shard_mode=mode))
    model = build_model(config.model, device=torch.device("cpu"), seed=config.train.seed)
    _keep_only_the_norms_gradients(model)
    micro = rank_micro_batches(global_batches(config, 1)[0], config.train.micro_batch_size)
    want = train_step(model, build_optimizer(model, config.optim), micro, device=torch.device("cpu"),
                      grad_clip=config.optim.grad_clip).grad_norm
    assert want > 0
    for got in run_distributed(_norms_gradient_norm, 4, config):
        assert got == pytest.approx(want, rel=NORM_RTOL_FIRST_STEP), (mode, got, want)


def test_zero1_bf16_tracks_one_process_bf16():
    """bf16: whole bf16 weights, fp32 reduction, fp32 master weights; one process uses fp32 weights +
    autocast. Both legitimate roundings: losses agree to 5e-3 relative over 3 steps (as FSDP's bf16 test)."""
    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import merge_rank_records, reference_run, run_parallel_rank

    config = tiny_config(moe=True, parallel=dict(dp_shard=2, ep=2, shard_mode="zero1"), train=dict(dtype="bf16"))
    want = reference_run(config, 3).losses
    got = merge_rank_records(run_distributed(run_parallel_rank, 2, config, 3)).losses
    assert got == pytest.approx(want, rel=5e-3)


def _train_with_small_buckets(rank: int, world: int, config):
    import functools

    import torch

    from optimus.optim.sharded import ShardedOptimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from tests.helpers import parity

    p = config.parallel
    dims = ParallelDims(dp_shard=p.dp_shard, ep=p.ep, world_size=world)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, torch.device("cpu"))
    optimizer = ShardedOptimizer(model, config.optim, model.zero_plan, bucket_numel=20_000)
    # many buckets: zero2 reduces each one from the backward hooks while the rest of backward runs
    assert len(optimizer.buckets) >= 4, len(optimizer.buckets)
    micro = functools.partial(parity.rank_micro_batches, micro_batch_size=config.train.micro_batch_size,
                              dp_rank=mesh.local_rank("dp"), dp_size=mesh.size("dp"))
    return parity.train_model(model, optimizer, config, 3, micro, mesh["dp"], keep_grads=rank == 0)


def test_zero2_many_buckets_matches_one_process():
    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import assert_parity, merge_rank_records, reference_run

    config = tiny_config(moe=True, parallel=dict(dp_shard=2, ep=2, shard_mode="zero2"))
    results = run_distributed(_train_with_small_buckets, 2, config)
    assert_parity(reference_run(config, 3), merge_rank_records(results))


def _gradients_held_after_backward(rank: int, world: int) -> dict:
    """zero1 and zero2 on the same dense model at dp 2: two micro-batches' forward + backward (no step),
    then the gradient bytes each optimizer holds (whole gradients, shards, buffers in flight) and the
    reduce-scatters issued during the backwards."""
    import torch

    from optimus.optim import sharded
    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from tests.helpers.parity import global_batches, rank_micro_batches
    from optimus.train.step import forward_backward

    dims = ParallelDims(dp_shard=2, world_size=world)
    mesh = dims.build_mesh("cpu")
    scatters = [0]
    original = sharded.reduce_scatter_single

    def counting(*args, **kwargs):
        scatters[0] += 1
        return original(*args, **kwargs)

    sharded.reduce_scatter_single = counting  # the name optim/sharded.py calls
    out = {}
    for mode in ("zero1", "zero2"):
        config = tiny_config(parallel=dict(dp_shard=2, shard_mode=mode))
        model = build_parallel_model(config, dims, mesh, torch.device("cpu"))
        optimizer = build_optimizer(model, config.optim)
        micro = rank_micro_batches(global_batches(config, 1)[0], config.train.micro_batch_size,
                                   mesh.local_rank("dp"), mesh.size("dp"))
        scatters[0] = 0
        forward_backward(model, micro, torch.device("cpu"), "fp32")
        out[mode] = {"held": optimizer.gradient_bytes(), "scatters": scatters[0], "buckets": len(optimizer.buckets),
                     "whole": sum(4 * p.numel() for p in model.parameters()), "micro_batches": len(micro),
                     "whole_grads_left": sum(p.grad is not None for p in model.parameters())}
    return out


def test_zero2_holds_a_1_over_dp_share_of_zero1s_gradients_after_backward():
    """zero1 keeps whole fp32 gradients until the step; zero2 reduce-scatters every bucket in every micro-batch's
    backward and keeps only its fp32 shard (1/dp of the elements, up to a bucket tail: within 1%)."""
    from tests.helpers.distributed import run_distributed

    for rank in run_distributed(_gradients_held_after_backward, 2):
        zero1, zero2 = rank["zero1"], rank["zero2"]
        assert zero1["held"] == zero1["whole"] and zero1["scatters"] == 0
        assert zero2["whole_grads_left"] == 0
        assert zero2["whole"] / 2 <= zero2["held"] <= 1.01 * zero1["held"] / 2, (zero2["held"], zero1["held"])
        assert zero2["scatters"] == zero2["micro_batches"] * zero2["buckets"] == 2 * zero2["buckets"]


def _train_watching_buffers(rank: int, world: int, poison: bool) -> dict:
    """zero1 and zero2, 3 steps of 2 micro-batches at dp `world` with small buckets (more buckets than the two
    buffers). Per step: where the buffers and gradient shards live, and this rank's shard padding (the tail of
    a bucket whose size is not a multiple of the ranks: at dp 3 some are). With `poison`, every buffer and shard
    is filled with NaN before each step (as if an earlier use had left anything there). Losses and a hash of
    the parameters, to compare runs."""
    import functools
    import hashlib

    import torch

    from optimus.optim.buffers import buffer_bytes_for
    from optimus.optim.sharded import ShardedOptimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from optimus.train.step import train_step
    from tests.helpers import parity

    dims = ParallelDims(dp_shard=world, world_size=world)
    mesh = dims.build_mesh("cpu")
    out = {}
    for mode in ("zero1", "zero2"):
        config = tiny_config(moe=True, model={"n_experts": 3}, parallel=dict(dp_shard=world, shard_mode=mode),
                             train=dict(global_batch_size=4 * world))
        model = build_parallel_model(config, dims, mesh, torch.device("cpu"))
        optimizer = ShardedOptimizer(model, config.optim, model.zero_plan, bucket_numel=20_000)
        micro = functools.partial(parity.rank_micro_batches, micro_batch_size=config.train.micro_batch_size,
                                  dp_rank=mesh.local_rank("dp"), dp_size=mesh.size("dp"))
        run = {"buckets": len(optimizer.buckets), "buffers": [], "shards": [], "tails": [], "losses": []}
        for batch in parity.global_batches(config, 3):
            if poison:
                for bucket in optimizer.buckets:
                    for view in optimizer.buffers.views(bucket.buffer, world, bucket.segment, torch.float32):
                        view.fill_(float("nan"))
                    if bucket.shard is not None:
                        bucket.shard.fill_(float("nan"))
            result = train_step(model, optimizer, micro(batch), device=torch.device("cpu"), dtype="fp32",
                                grad_clip=config.optim.grad_clip, dp_mesh=mesh["dp"])
            run["losses"].append(result.loss)
            run["buffers"].append([optimizer.buffers.data_ptr(i) for i in range(len(optimizer.buffers.nbytes))])
            run["shards"].append([b.shard.data_ptr() for b in optimizer.buckets])
            run["tails"].append([b.shard[b.held:].tolist() for b in optimizer.buckets])
        run["buffer_bytes"] = optimizer.buffer_bytes()
        run["predicted_buffer_bytes"] = buffer_bytes_for(model, world, world, 4, mode, 20_000)
        run["params"] = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        out[mode] = run
    return out


def test_bucket_buffers_are_allocated_once_and_reused_every_step():
    """The reduce-scatters and all-gathers go through two persistent buffers (optim/buffers.py) and one fp32
    shard per bucket, all allocated at the first step and at the same addresses in every later one; what is
    allocated is what the dry run's formula (buffer_bytes_for) predicts."""
    from tests.helpers.distributed import run_distributed

    for rank in run_distributed(_train_watching_buffers, 2, False):
        for mode, run in rank.items():
            assert run["buckets"] > 2, run["buckets"]  # buckets take turns over the buffers
            first = run["buffers"][0]
            assert len(first) == 2 and all(first), (mode, first)
            assert run["buffers"] == [first] * 3, (mode, run["buffers"])
            assert run["shards"] == [run["shards"][0]] * 3, mode
            assert run["buffer_bytes"] == run["predicted_buffer_bytes"] > 0, (mode, run["buffer_bytes"])


def test_padding_tails_reduce_to_zero_whatever_the_reused_buffers_held():
    """Buckets whose size is not a multiple of the ranks (dp 3): with every buffer and shard filled with NaN
    before each step, the last segment's padding tail is reduced to zeros every step (each rank zeroes the
    tail when packing) and training is bitwise the same as without the poison."""
    from tests.helpers.distributed import run_distributed

    clean = run_distributed(_train_watching_buffers, 3, False)
    poisoned = run_distributed(_train_watching_buffers, 3, True)
    tails = 0
    for clean_rank, poisoned_rank in zip(clean, poisoned):
        for mode, run in poisoned_rank.items():
            for step_tails in run["tails"]:
                for tail in step_tails:
                    assert tail == [0.0] * len(tail), (mode, tail[:8])
                    tails += len(tail)
            assert run["losses"] == clean_rank[mode]["losses"], mode
            assert run["params"] == clean_rank[mode]["params"], mode
    assert tails > 0  # some bucket's elements do not divide by 3: the last rank's segment has a tail to check


def _state_numel(rank: int, world: int, config):
    import math

    import torch

    from optimus.optim.sharded import ShardedOptimizer, ZeroPlan, expert_parameters
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model

    p = config.parallel
    dims = ParallelDims(dp_shard=p.dp_shard, ep=p.ep, world_size=world)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, torch.device("cpu"))
    experts = expert_parameters(model)

    def local(param):
        return param.to_local() if hasattr(param, "to_local") else param

    # what a rank owns when the parameters' local tensors are laid end to end (one bucket at the default size)
    # and cut into `ranks` equal segments
    def owned(ranks: int, index: int, params) -> int:
        total = sum(local(param).numel() for param in params)
        segment = math.ceil(total / ranks)
        return max(0, min(total, (index + 1) * segment) - index * segment)

    dense = [q for q in model.parameters() if q not in experts]
    out = {"non_expert_numel": sum(q.numel() for q in dense), "expert_numel": sum(q.numel() for q in experts),
           "want_aware": owned(mesh.size("dp"), mesh.local_rank("dp"), dense),
           "want_unaware": owned(mesh.size("expert_dp"), mesh.local_rank("expert_dp"), dense),
           "want_expert": owned(mesh.size("expert_dp"), mesh.local_rank("expert_dp"), experts)}
    for aware in (True, False):
        plan = ZeroPlan("zero1", aware, mesh, torch.float32)
        out[aware] = ShardedOptimizer(model, config.optim, plan).state_numel()
    return out


def test_ep_aware_state_is_sharded_over_dp_times_ep():
    """dp_shard 4 = dp 2 x ep 2: EP-aware, each rank keeps 1/4 of the non-expert moments (1/2 unaware, every
    ep rank repeating them); expert moments are 1/4 of the experts either way (ep 2 x expert_dp 2)."""
    from tests.helpers.distributed import run_distributed

    config = tiny_config(moe=True, parallel=dict(dp_shard=4, ep=2, shard_mode="zero1"))
    ranks = run_distributed(_state_numel, 4, config)
    dense, experts = ranks[0]["non_expert_numel"], ranks[0]["expert_numel"]
    for r in ranks:  # two fp32 moments per owned element; fp32 masters are the parameters' own rows
        assert r[True]["non_expert"] == 2 * r["want_aware"]
        assert r[False]["non_expert"] == 2 * r["want_unaware"]
        assert r[True]["expert"] == r[False]["expert"] == 2 * r["want_expert"]
    assert sum(r[True]["non_expert"] for r in ranks) == 2 * dense  # sharded once over all 4 ranks
    assert sum(r[False]["non_expert"] for r in ranks) == 2 * 2 * dense  # replicated across ep 2
    assert sum(r[True]["expert"] for r in ranks) == 2 * experts
    assert max(r[True]["non_expert"] for r in ranks) * 2 <= max(r[False]["non_expert"] for r in ranks) + 64


def _moments(model, optimizer) -> dict:
    """Every AdamW moment, whole, by flattened key (collective), from the checkpointed state dict."""
    import warnings

    from optimus.train.state import OptimizerState

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for key, value in sorted(OptimizerState(model, optimizer).state_dict().items()):
            if key.endswith(("exp_avg", "exp_avg_sq")):
                out[key] = value.full_tensor() if hasattr(value, "full_tensor") else value.detach().clone()
    return out


def _save_or_resume(rank: int, world: int, config, run_dir: str, resume: bool):
    """Train 2 steps and save (returns the moments), or load step 2 (returns the loaded moments) and train to 4."""
    import functools

    import torch

    from optimus.checkpoint.manager import CheckpointManager
    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from tests.helpers import parity
    from optimus.train.state import ModelState, OptimizerState

    p = config.parallel
    mesh = ParallelDims(dp_shard=p.dp_shard, ep=p.ep, world_size=world).build_mesh("cpu")
    model = build_parallel_model(config, ParallelDims(dp_shard=p.dp_shard, ep=p.ep, world_size=world), mesh,
                                 torch.device("cpu"))
    optimizer = build_optimizer(model, config.optim)
    micro = functools.partial(parity.rank_micro_batches, micro_batch_size=config.train.micro_batch_size,
                              dp_rank=mesh.local_rank("dp"), dp_size=mesh.size("dp"))
    loaded = None
    if resume:
        state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}
        CheckpointManager(run_dir, keep_last_k=10).load(2, state)
        loaded = _moments(model, optimizer)
        plan = parity.CheckpointPlan(run_dir, load_step=2)
        record = parity.train_model(model, optimizer, config, 4, micro, mesh["dp"], keep_grads=False, checkpoint=plan)
    else:
        plan = parity.CheckpointPlan(run_dir, save=True)
        record = parity.train_model(model, optimizer, config, 2, micro, mesh["dp"], keep_grads=False, checkpoint=plan)
        loaded = _moments(model, optimizer)
    return record.losses, (loaded if rank == 0 else None)


@pytest.mark.parametrize("resume_parallel", [
    dict(dp_shard=4, ep=2, shard_mode="zero1"),  # same mode and layout
    # zero1 ep 2 x dp 2 -> fsdp dp 4: DCP reshards the moments (make test-slow; make test reshards zero1 -> fsdp below)
    pytest.param(dict(dp_shard=4, shard_mode="fsdp"), marks=pytest.mark.slow),
], ids=["zero1", "fsdp-dp4"])
def test_zero1_ep_2_checkpoint_resumes(tmp_path, resume_parallel):
    """The moments come back exactly (whatever the layout) and the loss curve goes on as if never stopped."""
    import torch

    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import LOSS_RTOL_LATER_STEPS, reference_run

    before = tiny_config(moe=True, parallel=dict(dp_shard=4, ep=2, shard_mode="zero1"))
    after = tiny_config(moe=True, parallel=resume_parallel)
    reference = reference_run(before, 4)
    saved = run_distributed(_save_or_resume, 4, before, str(tmp_path), False)
    resumed = run_distributed(_save_or_resume, 4, after, str(tmp_path), True)
    want, got = saved[0][1], resumed[0][1]
    assert sorted(want) == sorted(got) and len(want) > 10
    for key in want:
        assert torch.equal(want[key], got[key]), key
    curve = saved[0][0] + resumed[0][0]
    assert len(curve) == 4
    for want_loss, got_loss in zip(reference.losses, curve):
        assert abs(got_loss - want_loss) <= LOSS_RTOL_LATER_STEPS * abs(want_loss), (curve, reference.losses)


@pytest.mark.slow  # the way back: fsdp dp 4 -> zero2 EP-unaware ep 2 x dp 2
def test_fsdp_checkpoint_resumes_under_zero2_ep_2(tmp_path):
    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import LOSS_RTOL_LATER_STEPS, CheckpointPlan, reference_run, run_parallel_rank

    before = tiny_config(moe=True, parallel=dict(dp_shard=4))
    after = tiny_config(moe=True, parallel=dict(dp_shard=4, ep=2, shard_mode="zero2", ep_aware=False))
    reference = reference_run(before, 4)
    saved = run_distributed(run_parallel_rank, 4, before, 2, CheckpointPlan(str(tmp_path), save=True))
    resumed = run_distributed(run_parallel_rank, 4, after, 4, CheckpointPlan(str(tmp_path), load_step=2))
    curve = saved[0].losses + resumed[0].losses
    for want, got in zip(reference.losses, curve):
        assert abs(got - want) <= LOSS_RTOL_LATER_STEPS * abs(want), (curve, reference.losses)


def test_trainer_zero2_ep_2_trains_and_resumes_like_one_process(tmp_path):
    """The real Trainer path (data loader, checkpoint callback, resume from `latest`) under zero2 at
    dp_shard 2 = ep 2: 2 steps, then the same command resumed to 4, logs one process's losses."""
    import json

    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import LOSS_RTOL_LATER_STEPS
    from optimus.train.trainer import Trainer

    one, two = tmp_path / "one", tmp_path / "two"
    Trainer(small_moe_trainer_config(str(one), 4, {}), progress_bar=False).fit()
    parallel = dict(dp_shard=2, ep=2, shard_mode="zero2")
    run_distributed(train_small_moe_on_rank, 2, str(two), 2, parallel)
    run_distributed(train_small_moe_on_rank, 2, str(two), 4, parallel)

    def losses(run_dir):
        return [(m["step"], m["loss"]) for m in map(json.loads, open(f"{run_dir}/metrics.jsonl")) if "loss" in m]

    want, got = losses(one), losses(two)
    assert [step for step, _ in got] == [1, 2, 3, 4]
    for (step, loss), (_, reference) in zip(got, want):
        assert loss == pytest.approx(reference, rel=LOSS_RTOL_LATER_STEPS), (step, got, want)


@pytest.mark.slow  # bf16 on an AVX2 CPU is slow; the fp32 resume tests cover the same code path
def test_zero1_bf16_resume_restores_fp32_masters(tmp_path):
    """bf16 whole parameters: the fp32 master blocks are checkpointed ("state.<name>.master"), so a
    resumed run repeats the uninterrupted one exactly (re-deriving masters from bf16 would not)."""
    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import CheckpointPlan, run_parallel_rank

    config = tiny_config(moe=True, parallel=dict(dp_shard=2, ep=2, shard_mode="zero1"), train=dict(dtype="bf16"))
    straight = run_distributed(run_parallel_rank, 2, config, 4)[0].losses
    saved = run_distributed(run_parallel_rank, 2, config, 2, CheckpointPlan(str(tmp_path), save=True))
    resumed = run_distributed(run_parallel_rank, 2, config, 4, CheckpointPlan(str(tmp_path), load_step=2))
    assert saved[0].losses + resumed[0].losses == pytest.approx(straight, rel=1e-6, abs=0)


BF16_TINY = dict(model={"n_layers": 1}, train=dict(dtype="bf16", global_batch_size=4, seq_len=16))  # 1 micro-batch a rank
NAMES = ["layers.0.attn.q_proj.weight", "layers.0.mlp.down_proj.weight", "norm.weight"]


def _fp32_weights_at_load(rank: int, world: int, config, steps: int, plan):
    """run_parallel_rank; (rank 0) also the fp32 weights of NAMES whole: those a checkpoint of `steps` steps
    saved (fsdp's sharded parameters, read back into a fresh fsdp model), or zero1's fp32 masters just
    after loading one."""
    import torch

    from optimus.checkpoint.manager import CheckpointManager
    from optimus.optim.sharded import ShardedOptimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from tests.helpers import parity
    from optimus.train.state import ModelState

    weights = {}
    checkpoint_io = parity._checkpoint_io

    def io_then_read_masters(model, optimizer, run_dir, step, save):
        checkpoint_io(model, optimizer, run_dir, step, save)
        if not save and isinstance(optimizer, ShardedOptimizer):
            state = optimizer.state_dict()
            weights.update({name: state[f"state.{name}.master"].full_tensor() for name in NAMES})

    parity._checkpoint_io = io_then_read_masters  # this forked rank only
    record = parity.run_parallel_rank(rank, world, config, steps, plan)
    if plan.save:
        dims = ParallelDims(dp_shard=world, world_size=world)
        model = build_parallel_model(config, dims, dims.build_mesh("cpu"), torch.device("cpu"))
        CheckpointManager(plan.run_dir, keep_last_k=10).load(steps, {"model": ModelState(model)})
        params = dict(model.named_parameters())
        weights = {name: params[name].full_tensor() for name in NAMES}
    return record.losses, (weights if rank == 0 else None)


def test_fsdp_bf16_checkpoint_resumes_under_zero1_bf16_with_masters_from_its_fp32_parameters(tmp_path, capfd):
    """An fsdp run saves no master weights (its sharded fp32 parameters are them): a bf16 zero1 run loading
    its checkpoint takes the fp32 masters from those saved parameters bit for bit (not from their bf16
    copies) and says so in one line; its next loss is the fsdp run's own continuation within 5e-3 relative
    (bf16 forwards: fsdp's bf16 gather vs zero1's whole bf16 weights, as in test_zero1_bf16_tracks_...)."""
    import torch

    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import CheckpointPlan, run_parallel_rank

    fsdp = tiny_config(parallel=dict(dp_shard=2), **BF16_TINY)
    zero1 = tiny_config(parallel=dict(dp_shard=2, shard_mode="zero1"), **BF16_TINY)
    straight = run_distributed(run_parallel_rank, 2, fsdp, 3)[0].losses
    saved = run_distributed(_fp32_weights_at_load, 2, fsdp, 2, CheckpointPlan(str(tmp_path), save=True))[0]
    resumed = run_distributed(_fp32_weights_at_load, 2, zero1, 3, CheckpointPlan(str(tmp_path), load_step=2))[0]
    assert capfd.readouterr().err.count("entries read from other entries it holds") == 1
    for name in NAMES:
        assert resumed[1][name].dtype == saved[1][name].dtype == torch.float32
        assert torch.equal(resumed[1][name], saved[1][name]), name
    assert saved[0] == straight[:2] and len(resumed[0]) == 1
    assert resumed[0] == pytest.approx(straight[2:], rel=5e-3)


def _fsdp_weights_from(rank: int, world: int, config, run_dir: str, step: int):
    """(rank 0) NAMES' fp32 weights whole, as a fresh fsdp model of `config` loads them from a checkpoint."""
    import torch

    from optimus.checkpoint.manager import CheckpointManager
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from optimus.train.state import ModelState

    dims = ParallelDims(dp_shard=world, world_size=world)
    model = build_parallel_model(config, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    CheckpointManager(run_dir, keep_last_k=10).load(step, {"model": ModelState(model)})
    params = dict(model.named_parameters())
    weights = {name: params[name].full_tensor() for name in NAMES}  # collective: every rank gathers
    return weights if rank == 0 else None


def test_zero1_bf16_checkpoint_resumes_under_fsdp_from_its_fp32_masters(tmp_path, capfd):
    """The way back: a bf16 zero1 run saves bf16 parameters and fp32 masters beside them; an fsdp (fp32-weight)
    model loading it reads the masters bit for bit, not the bf16-rounded parameters, and says so in one line."""
    import torch

    from tests.helpers.distributed import run_distributed
    from tests.helpers.parity import CheckpointPlan, run_parallel_rank

    fsdp = tiny_config(parallel=dict(dp_shard=2), **BF16_TINY)
    zero1 = tiny_config(parallel=dict(dp_shard=2, shard_mode="zero1"), **BF16_TINY)
    run_distributed(run_parallel_rank, 2, zero1, 2, CheckpointPlan(str(tmp_path), save=True))
    capfd.readouterr()
    loaded = run_distributed(_fsdp_weights_from, 2, fsdp, str(tmp_path), 2)[0]
    assert capfd.readouterr().err.count("entries read from other entries it holds") == 1
    masters = run_distributed(_fp32_weights_at_load, 2, zero1, 3, CheckpointPlan(str(tmp_path), load_step=2))[0][1]
    for name in NAMES:
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], masters[name]), name
    # and they are not bf16 values: two steps of fp32 AdamW moved them off the bf16 grid
    assert any(not torch.equal(loaded[n], loaded[n].bfloat16().float()) for n in NAMES)




def _groups_clip_and_lr(rank: int, world: int, config) -> dict:
    import torch

    from optimus.optim.build import param_groups, set_lr
    from tests.helpers import parity

    model, optimizer = _zero_optimizer(world, config)
    wanted = {id(p): g["weight_decay"] for g in param_groups(model, config.optim.weight_decay) for p in g["params"]}
    decay_kept = all(optimizer._group_of[id(slot.master)]["weight_decay"] == wanted[id(slot.param)]
                     for slot, _ in optimizer._slots.values())
    kinds = sorted({g["weight_decay"] for g in optimizer.param_groups})
    inputs, labels = parity.global_batches(config, 1)[0]
    share = slice(rank * len(inputs) // world, (rank + 1) * len(inputs) // world)
    model(inputs[share], labels=labels[share]).loss.backward()
    norm = optimizer.clip_grad_norm_(0.0)  # 0: no clipping, the norm only
    shards = [bucket.grad_shard.clone() for bucket in optimizer.buckets]
    again = optimizer.clip_grad_norm_(norm * 100)  # far above the norm: torch caps the coefficient at 1
    unchanged = all(torch.equal(before, bucket.grad_shard) for before, bucket in zip(shards, optimizer.buckets))
    set_lr(optimizer, 0.125)
    return {"decay_kept": decay_kept, "kinds": kinds, "norm": norm, "again": again, "unchanged": unchanged,
            "lrs": [g["lr"] for g in optimizer.param_groups]}


@pytest.mark.parametrize("mode", ["zero1", "zero2"])
def test_decay_groups_clip_cap_and_learning_rate_reach_every_shard(mode):
    """Each master keeps its parameter's weight decay (norms, biases and embeddings none: optim/build.py), a clip
    threshold above the norm (or 0) leaves the gradients as they are instead of scaling them up, and the learning
    rate the trainer sets reaches every group. (The parity tests' gradients always exceed their threshold and both
    sides share the decay rule, so neither shows a swapped group or an uncapped coefficient.)"""
    config = tiny_config(parallel=dict(dp_shard=2, shard_mode=mode), optim=dict(weight_decay=0.1))
    for out in run_distributed(_groups_clip_and_lr, 2, config):
        assert out["decay_kept"] and out["kinds"] == [0.0, 0.1]
        assert out["unchanged"] and out["again"] == pytest.approx(out["norm"], rel=1e-6) and out["norm"] > 0
        assert out["lrs"] == [0.125] * len(out["lrs"])


def _zero_optimizer(world: int, config, bucket_numel: int = 20_000):
    """(on a rank) `config`'s parallel model and a ShardedOptimizer over it with small buckets (several of them)."""
    import torch

    from optimus.optim.sharded import ShardedOptimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model

    dims = ParallelDims.from_config(config.parallel, world)
    model = build_parallel_model(config, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    return model, ShardedOptimizer(model, config.optim, model.zero_plan, bucket_numel=bucket_numel)


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _decay_on_zero_gradients(rank: int, world: int, config, lr: float) -> dict:
    """One zero1 step from all-zero gradients at learning rate `lr`: each parameter's (local) values after / before,
    by name (AdamW's moments stay 0, so its update is 0 and only the decoupled weight decay moves a weight); and
    whether every group of the masters' AdamW runs the fused kernel."""
    import torch

    from optimus.optim.build import set_lr

    model, optimizer = _zero_optimizer(world, config)
    before = {name: _local(p).detach().clone() for name, p in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    set_lr(optimizer, lr)
    optimizer.clip_grad_norm_(config.optim.grad_clip)
    optimizer.step()
    return {"params": {name: (_local(p).detach().clone(), before[name]) for name, p in model.named_parameters()},
            "fused": [group["fused"] for group in optimizer.param_groups]}


def test_the_masters_adamw_decays_matrices_only_and_runs_fused():
    """The sharded optimizer's masters keep build.param_groups' decay: with zero gradients a step multiplies each
    decaying weight by exactly 1 - lr x weight_decay and leaves every other one as it was (OLMo's rule: matrices
    decay; norms, biases and the embedding do not). The parity tests cannot see this: at their lr 3e-3 decay moves
    the weights by 3e-4 relative a step, below their loss tolerance. MoE at dp 2 = ep 2: the experts' group too.
    The masters are plain CPU tensors: torch's fused kernel applies (build.adamw_kernel's choice: 6x foreach's speed
    on CPU)."""
    from tests.helpers.distributed import run_distributed

    lr, weight_decay = 0.5, 0.1
    config = tiny_config(moe=True, parallel=dict(dp_shard=2, ep=2, shard_mode="zero1"),
                         optim=dict(weight_decay=weight_decay))
    decayed = kept = 0
    for rank in run_distributed(_decay_on_zero_gradients, 2, config, lr):
        assert rank["fused"] == [True, True], rank["fused"]
        for name, (after, before) in rank["params"].items():
            if before.ndim >= 2 and name != "embed.weight" and "norm" not in name:
                # fp32: one rounding of the product (rel 6e-8); 1e-6 is far below a skipped or doubled decay (5e-2)
                torch.testing.assert_close(after, before * (1 - lr * weight_decay), rtol=1e-6, atol=0, msg=name)
                decayed += 1
            else:
                assert torch.equal(after, before), name
                kept += 1
    assert decayed and kept and any("experts" in name for name in rank["params"])


def _gradient(name: str, shape) -> torch.Tensor:
    """A fixed gradient for parameter `name`, the same on every rank (seeded by the name's bytes)."""
    import torch

    generator = torch.Generator().manual_seed(sum(name.encode()))
    return torch.randn(shape, generator=generator)


def _clip_set_gradients(rank: int, world: int, config, missing: str, max_norms: list) -> list:
    """zero1 over `world` ranks: every parameter but `missing` given the same gradient on every rank (_gradient), the
    buffers filled with NaN first (as a reused buffer may hold anything); per max_norm, the norm clip_grad_norm_
    returns and the reduced gradients after clipping (whole, rank 0)."""
    import torch

    model, optimizer = _zero_optimizer(world, config)
    out = []
    for max_norm in max_norms:
        optimizer.zero_grad()
        for bucket in optimizer.buckets:
            for view in optimizer.buffers.views(bucket.buffer, world, bucket.segment, torch.float32):
                view.fill_(float("nan"))
        for name, param in model.named_parameters():
            if name != missing:
                param.grad = _gradient(name, param.shape)
        norm = optimizer.clip_grad_norm_(max_norm)
        grads = optimizer.full_gradients()  # (collective)
        out.append((norm, grads if rank == 0 else None))
    return out


def test_clipping_leaves_gradients_under_max_norm_alone_and_a_parameter_without_one_adds_zeros():
    """Identical gradients on both dp ranks average to themselves exactly, so the reduced gradients are known: a
    parameter that got none this step reduces to zeros (not to what the reused buffer held), the norm is theirs,
    max_norm 0 (no clipping: grad_clip 0, or clip_after_warmup during warm-up) and a max_norm above the norm leave
    them as they are, and a max_norm below scales them by max_norm / (norm + 1e-6) (torch's formula). The parity
    runs' norms all exceed their grad_clip, so they never see the first two."""
    from tests.helpers.distributed import run_distributed

    config = tiny_config(parallel=dict(dp_shard=2, shard_mode="zero1"))
    missing = "layers.1.mlp.up_proj.weight"
    results = run_distributed(_clip_set_gradients, 2, config, missing, [0.0, 1e6, 1.0])[0]
    grads = results[0][1]
    assert torch.equal(grads[missing], torch.zeros_like(grads[missing]))
    want = {name: _gradient(name, grad.shape) for name, grad in grads.items() if name != missing}
    norm = torch.cat([g.double().flatten() for g in want.values()]).norm().item()
    assert norm > 1.0  # so max_norm 1.0 clips
    for (got_norm, got), scale in zip(results, [1.0, 1.0, 1.0 / (norm + 1e-6)]):
        # fp32 sums of the squares of 2e5 elements: rounding ~1e-7 relative; a mutated norm or scale is off by a
        # factor (sqrt 2, max_norm / norm, 0)
        assert got_norm == pytest.approx(norm, rel=1e-5)
        assert torch.equal(got[missing], torch.zeros_like(got[missing]))
        for name, grad in want.items():
            # x + x and / 2 are exact in fp32: the reduced gradients are the set ones, times the clipping's coefficient
            # (computed from the fp32 norm: within 1e-5 of ours)
            torch.testing.assert_close(got[name], grad * scale, rtol=1e-5, atol=0, msg=name)


def _copy_state_between_optimizers(rank: int, world: int, config, other_config) -> list:
    """Optimizer A (of `config`) takes a step; optimizer B, of another model and other hyperparameters, loads
    A.state_dict(), a state dict that is not a view of B's own state. The keys whose values then differ."""
    import torch

    model, first = _zero_optimizer(world, config)
    for name, param in model.named_parameters():
        param.grad = _gradient(name, param.shape)
    first.clip_grad_norm_(0.0)
    first.step()
    _, second = _zero_optimizer(world, other_config)
    second.load_state_dict(first.state_dict())
    want, got = first.state_dict(), second.state_dict()
    assert sorted(want) == sorted(got)

    def value(entry):
        return entry.local() if hasattr(entry, "local") else entry

    return [key for key in want if not (torch.equal(value(want[key]), value(got[key])) if torch.is_tensor(want[key])
                                        else want[key] == got[key])]


def test_loading_another_optimizers_state_dict_copies_its_moments_and_hyperparameters():
    """DCP loads a checkpoint in place (the state dict's tensors are views of the live state: nothing to copy); a
    state dict from elsewhere is copied, moments and step counts, and its param groups' hyperparameters replace the
    optimizer's own, as torch's load_state_dict (and FSDP's set_optimizer_state_dict) do."""
    from tests.helpers.distributed import run_distributed

    parallel = dict(dp_shard=2, shard_mode="zero1")
    other = tiny_config(parallel=parallel, optim=dict(weight_decay=0.2, betas=(0.5, 0.6), eps=1e-3))
    for differing in run_distributed(_copy_state_between_optimizers, 2, tiny_config(parallel=parallel), other):
        assert differing == []


def _step_after_loading_without_masters(rank: int, world: int, config) -> list:
    """bf16 zero1: the whole parameters doubled (exact in bf16), then a state dict without fp32 masters loaded and
    one step from zero gradients taken (no decay: it moves nothing). The parameters that step left not doubled."""
    import torch

    model, optimizer = _zero_optimizer(world, config)
    state = {key: value for key, value in optimizer.state_dict().items() if not key.endswith(".master")}
    assert len(state) < len(optimizer.state_dict())  # bf16: there were masters to leave out
    doubled = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.mul_(2)
            doubled[name] = param.detach().clone()
    optimizer.load_state_dict(state)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.clip_grad_norm_(0.0)
    optimizer.step()
    return [name for name, param in model.named_parameters() if not torch.equal(param.detach(), doubled[name])]


def test_a_state_dict_without_masters_takes_them_from_the_loaded_parameters():
    """bf16 parameters have fp32 masters of their own; a state dict without them (ShardedOptimizer.load_state_dict's
    contract) takes them from the whole parameters as loaded, else the next step's all-gather would write the
    masters from before the load back into the parameters."""
    from tests.helpers.distributed import run_distributed

    config = tiny_config(parallel=dict(dp_shard=2, shard_mode="zero1"), train=dict(dtype="bf16"),
                         optim=dict(weight_decay=0.0))
    for reverted in run_distributed(_step_after_loading_without_masters, 2, config):
        assert reverted == []
