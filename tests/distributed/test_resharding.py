"""A DCP checkpoint written at one layout resumes at another, and the loss curve goes on as if the
run had never stopped (compared with an uninterrupted single-process run, parity tolerances).

Steps 1-2 run at layout A and save model + optimizer; steps 3-5 load them at layout B.
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.runs import small_moe_trainer_config, train_small_moe_on_rank
from tests.helpers.parity import (
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


def _logged_losses(run_dir) -> list[tuple[int, float]]:
    import json

    lines = (json.loads(line) for line in open(f"{run_dir}/metrics.jsonl"))
    return [(m["step"], m["loss"]) for m in lines if "loss" in m]


@pytest.mark.slow
def test_trainer_resumes_one_process_checkpoint_at_tp_2_dp_shard_2(tmp_path):
    """The real Trainer path: 2 steps in one process, then the same run directory resumed by 4 ranks
    (tp=2 x dp_shard=2, MoE) continues exactly as the one process continues."""
    import shutil

    from optimus.train.trainer import Trainer

    one, four = tmp_path / "one", tmp_path / "four"
    Trainer(small_moe_trainer_config(str(one), 2, {}), progress_bar=False).fit()
    shutil.copytree(one, four)
    Trainer(small_moe_trainer_config(str(one), 4, {}), progress_bar=False).fit()
    run_distributed(train_small_moe_on_rank, 4, str(four), 4, dict(tp=2, dp_shard=2))
    want, got = _logged_losses(one), _logged_losses(four)
    # each step logged once: the 4 ranks resumed at step 3 rather than starting again
    assert [step for step, _ in got] == [1, 2, 3, 4]
    for (step, loss), (_, reference) in zip(got[2:], want[2:]):
        assert loss == pytest.approx(reference, rel=LOSS_RTOL_LATER_STEPS), (step, got, want)


def test_tp_2_checkpoint_with_a_vocab_parallel_head_resumes_in_one_process(tmp_path):
    """The LM head (and embedding) split over the vocabulary at tp=2, unevenly (1,001 rows), is one DTensor
    per key: DCP gathers it back for one process and the curve goes on."""
    before = tiny_config(model=dict(vocab_size=1001), parallel=dict(tp=2))
    after = tiny_config(model=dict(vocab_size=1001))
    reference = reference_run(after, STEPS)
    saved = run_distributed(run_parallel_rank, 2, before, SAVE_AT, CheckpointPlan(str(tmp_path), save=True))
    resumed = run_single_process(after, STEPS, CheckpointPlan(str(tmp_path), load_step=SAVE_AT))
    _assert_curve_continues(reference.losses, saved[0].losses, resumed.losses)
