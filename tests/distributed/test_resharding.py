"""A DCP checkpoint written at one layout resumes at another, and the loss curve goes on as if the
run had never stopped (compared with an uninterrupted single-process run, parity tolerances).

Steps 1-2 run at layout A and save model + optimizer; steps 3-5 load them at layout B.
"""

from __future__ import annotations

import pytest

from optimus.testing.distributed import run_distributed
from optimus.testing.parity import (
    LOSS_RTOL_LATER_STEPS,
    CheckpointPlan,
    reference_run,
    run_parallel_rank,
    run_single_process,
    tiny_config,
)

pytestmark = pytest.mark.distributed

STEPS, SAVE_AT = 5, 2


def _assert_curve_continues(reference: list[float], first_part: list[float], resumed: list[float]) -> None:
    curve = first_part + resumed
    assert len(curve) == len(reference)
    for step, (want, got) in enumerate(zip(reference, curve), start=1):
        assert abs(got - want) <= LOSS_RTOL_LATER_STEPS * abs(want), f"step {step}: {curve} vs {reference}"


def test_dp_shard_4_checkpoint_resumes_at_tp_2(tmp_path):
    before = tiny_config(parallel=dict(dp_shard=4))
    after = tiny_config(parallel=dict(tp=2))
    reference = reference_run(before, STEPS)
    saved = run_distributed(run_parallel_rank, 4, before, SAVE_AT, CheckpointPlan(str(tmp_path), save=True))
    resumed = run_distributed(run_parallel_rank, 2, after, STEPS, CheckpointPlan(str(tmp_path), load_step=SAVE_AT))
    _assert_curve_continues(reference.losses, saved[0].losses, resumed[0].losses)


def test_single_process_checkpoint_resumes_at_dp_shard_2(tmp_path):
    before = tiny_config(moe=True)
    after = tiny_config(moe=True, parallel=dict(dp_shard=2))
    reference = reference_run(before, STEPS)
    saved = run_single_process(before, SAVE_AT, CheckpointPlan(str(tmp_path), save=True))
    resumed = run_distributed(run_parallel_rank, 2, after, STEPS, CheckpointPlan(str(tmp_path), load_step=SAVE_AT))
    _assert_curve_continues(reference.losses, saved.losses, resumed[0].losses)
