"""parallel.grad_reduce_dtype=bf16: every shard mode sends its gradients across data-parallel ranks in bf16 (the
collectives are recorded), and still trains what one process trains, to bf16's rounding of the sums
(tests.helpers.parity.assert_bf16_reduction_parity states the tolerances, and fails a run left in fp32)."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import (assert_bf16_reduction_parity, merge_rank_records, reference_run, run_parallel_rank,
                                  tiny_config)

pytestmark = pytest.mark.distributed

REDUCTIONS = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor")


def _train_recording_reductions(rank: int, world: int, config, steps: int):
    """run_parallel_rank with torch.distributed's reductions wrapped: the dtypes of every gradient-sized one (more
    than 16 elements: the loss average, the norm and the tiny model's smallest tensors are left out; and not fp64:
    the pipeline's loss and router statistics, which are no gradients)."""
    import torch
    import torch.distributed as dist

    dtypes: set[str] = set()

    def recording(collective):
        def call(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dtype != torch.float64]
            if any(t.numel() > 16 for t in tensors):
                dtypes.add(str(tensors[-1].dtype if "reduce_scatter" in collective.__name__ else tensors[0].dtype))
            return collective(*args, **kwargs)
        return call

    for name in REDUCTIONS:
        if hasattr(dist, name):
            setattr(dist, name, recording(getattr(dist, name)))
    return run_parallel_rank(rank, world, config, steps), sorted(dtypes)


def _run(config, world: int, steps: int = 3):
    results = run_distributed(_train_recording_reductions, world, config, steps)
    assert all(dtypes == ["torch.bfloat16"] for _, dtypes in results), [dtypes for _, dtypes in results]
    return merge_rank_records([record for record, _ in results])


def _check_bf16_reduction(config, world: int, steps: int = 3) -> None:
    assert_bf16_reduction_parity(reference_run(config, steps), _run(config, world, steps))


@pytest.mark.parametrize("mode", ["fsdp", "zero1", "zero2", "ddp"])
def test_dense_dp_2_reduces_in_bf16_and_tracks_one_process(mode):
    _check_bf16_reduction(tiny_config(parallel=dict(dp_shard=2, shard_mode=mode, grad_reduce_dtype="bf16")), 2)


@pytest.mark.parametrize("mode", ["fsdp", "zero2"])
def test_moe_dp_4_ep_2_reduces_in_bf16_and_tracks_one_process(mode):
    # experts over expert_dp, the rest over dp x ep; zero2 accumulates two micro-batches' bf16 sums in fp32
    parallel = dict(dp_shard=4, ep=2, shard_mode=mode, grad_reduce_dtype="bf16")
    _check_bf16_reduction(tiny_config(moe=True, parallel=parallel, train=dict(micro_batch_size=1)), 4)


def test_hsdp_with_two_micro_batches_reduces_and_accumulates_in_bf16():
    # HSDP defers its all-reduce to the last micro-batch (defer_grad_sync=replicate): FSDP sums the micro-batches'
    # reduce-scattered shards in bf16 meanwhile
    parallel = dict(dp_replicate=2, dp_shard=2, grad_reduce_dtype="bf16")
    _check_bf16_reduction(tiny_config(parallel=parallel, train=dict(micro_batch_size=1)), 4)


def test_fsdp_under_pp_accumulates_its_deferred_gradients_in_bf16():
    # torch's pipeline stages reduce once after the last backward; FSDP accumulates the unsharded gradients in the
    # dtype it reduces in meanwhile
    parallel = dict(dp_shard=2, pp=2, pp_schedule="1f1b", grad_reduce_dtype="bf16")
    _check_bf16_reduction(tiny_config(moe=True, model={"n_layers": 4}, parallel=parallel), 4)


@pytest.mark.parametrize("mode", ["fsdp", "zero1"])
def test_bf16_compute_with_bf16_reduction_tracks_one_process_in_bf16(mode):
    """The recipes' setting: bf16 compute, gradients reduced in bf16. One process computes bf16 under autocast over
    fp32 weights: both legitimate roundings, losses within 5e-3 relative over 3 steps (as the other bf16 tests)."""
    config = tiny_config(moe=True, parallel=dict(dp_shard=2, ep=2, shard_mode=mode, grad_reduce_dtype="bf16"),
                         train=dict(dtype="bf16"))
    got = _run(config, 2)
    assert got.losses == pytest.approx(reference_run(config, 3).losses, rel=5e-3)


def _trainer_output(rank: int, world: int, run_dir: str, token_dir: str) -> str:
    import contextlib
    import io
    import os

    from optimus.config import build_config
    from optimus.train.trainer import Trainer
    from tests.helpers.runs import tiny_run_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # as torchrun would
    train = dict(max_steps=1, ckpt_every=0, global_batch_size=4)
    config = build_config(tiny_run_config(run_dir, token_dir, train=train,
                                          parallel=dict(dp_shard=2, grad_reduce_dtype="bf16")))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        Trainer(config, progress_bar=False).fit()
    return out.getvalue()


def test_the_trainer_says_its_gradients_are_reduced_in_bf16(tmp_path, small_token_dir):
    first, second = run_distributed(_trainer_output, 2, str(tmp_path), str(small_token_dir), timeout=120)
    assert "gradients reduced in bf16 over the 2 data-parallel ranks" in first
    assert "gradients reduced" not in second  # rank 0 speaks for the job
