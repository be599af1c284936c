"""parallel.grad_reduce_dtype=bf16: every shard mode sends its gradients across data-parallel ranks in bf16 (the
collectives are recorded), and still trains what one process trains, to bf16's rounding of the sums.

Tolerances (fp32 compute, so the only rounding is the reduction's): each gradient is rounded to bf16 before it
travels and each partial sum after (2^-9 relative each), the clipping coefficient comes from the rounded norm:
step-1 gradients within 1e-2 of the largest element of their tensor plus 1e-2 relative, gradient norms 1e-2
relative, losses 5e-3 relative over 3 steps (the bf16 tests' bound). And they must NOT all be within the fp32
parity tolerance: a reduction left in fp32 would pass the loose bound too.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import GRAD_ATOL, GRAD_RTOL, merge_rank_records, reference_run, run_parallel_rank, tiny_config

pytestmark = pytest.mark.distributed

GRAD_TOL = 1e-2
NORM_RTOL = 1e-2
LOSS_RTOL = 5e-3
REDUCTIONS = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor")


def _train_recording_reductions(rank: int, world: int, config, steps: int):
    """run_parallel_rank with torch.distributed's reductions wrapped: the dtypes of every gradient-sized one (more
    than 16 elements: the loss average, the norm and the tiny model's smallest tensors are left out)."""
    import torch.distributed as dist

    dtypes: set[str] = set()

    def recording(collective):
        def call(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if any(t.numel() > 16 for t in tensors):
                dtypes.add(str(tensors[-1].dtype if "reduce_scatter" in collective.__name__ else tensors[0].dtype))
            return collective(*args, **kwargs)
        return call

    for name in REDUCTIONS:
        if hasattr(dist, name):
            setattr(dist, name, recording(getattr(dist, name)))
    return run_parallel_rank(rank, world, config, steps), sorted(dtypes)


def _check_bf16_reduction(config, world: int, steps: int = 3) -> None:
    want = reference_run(config, steps)
    results = run_distributed(_train_recording_reductions, world, config, steps)
    assert all(dtypes == ["torch.bfloat16"] for _, dtypes in results), [dtypes for _, dtypes in results]
    got = merge_rank_records([record for record, _ in results])
    assert got.losses == pytest.approx(want.losses, rel=LOSS_RTOL)
    assert got.grad_norms == pytest.approx(want.grad_norms, rel=NORM_RTOL)
    beyond_fp32 = False
    for name, reference in want.grads.items():
        grad = got.grads[name]
        bound = GRAD_TOL * reference.abs().max() + GRAD_TOL * reference.abs()
        worst = ((grad - reference).abs() - bound).max().item()
        assert worst <= 0, f"{name}: gradient departs from one process by more than bf16 rounding ({worst:.3e})"
        beyond_fp32 |= not torch.allclose(grad, reference, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    assert beyond_fp32, "every gradient equals one process's to fp32 rounding: was anything reduced in bf16?"


@pytest.mark.parametrize("mode", ["fsdp", "zero1", "zero2", "ddp"])
def test_dense_dp_2_reduces_in_bf16_and_tracks_one_process(mode):
    _check_bf16_reduction(tiny_config(parallel=dict(dp_shard=2, shard_mode=mode, grad_reduce_dtype="bf16")), 2)


@pytest.mark.parametrize("mode", ["fsdp", "zero2"])
def test_moe_dp_4_ep_2_reduces_in_bf16_and_tracks_one_process(mode):
    # experts over expert_dp, the rest over dp x ep; zero2 accumulates two micro-batches' bf16 sums in fp32
    parallel = dict(dp_shard=4, ep=2, shard_mode=mode, grad_reduce_dtype="bf16")
    _check_bf16_reduction(tiny_config(moe=True, parallel=parallel, train=dict(micro_batch_size=1)), 4)


def test_hsdp_all_reduce_is_bf16_too():
    parallel = dict(dp_replicate=2, dp_shard=2, grad_reduce_dtype="bf16")
    _check_bf16_reduction(tiny_config(parallel=parallel), 4)


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
