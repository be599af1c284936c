"""train/callbacks/evaluation.py: when the held-out loss is computed, and that a non-finite one stops the run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from optimus.resilience.guards import NonFiniteHeldOutLoss
from optimus.train.callbacks.evaluation import Evaluation


def _evaluation(loss: float, eval_every: int = 0) -> tuple[Evaluation, list[int]]:
    trainer = SimpleNamespace(config=SimpleNamespace(train=SimpleNamespace(max_steps=6, eval_every=eval_every)),
                              consecutive_skips=SimpleNamespace(count=2))
    evaluation, ran = Evaluation(trainer), []
    evaluation.run = lambda step: ran.append(step) or loss
    return evaluation, ran


def test_evaluation_runs_every_eval_every_steps_and_at_the_last():
    evaluation, ran = _evaluation(2.5, eval_every=4)
    for step in range(1, 7):
        evaluation.after_step(step)
    assert ran == [4, 6] and evaluation.last_loss == 2.5


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_held_out_loss_stops_the_run_before_its_checkpoint(loss):
    """Weights that give a NaN or an infinite loss are not worth saving (the checkpoint callback comes after)."""
    evaluation, _ = _evaluation(loss)
    with pytest.raises(NonFiniteHeldOutLoss, match=f"step 6: the held-out loss is {loss}.*last 2 optimizer step"):
        evaluation.after_step(6)


def test_a_held_out_loss_that_is_not_finite_names_no_skipped_steps_when_none_were():
    evaluation, _ = _evaluation(float("nan"))
    evaluation.trainer.consecutive_skips.count = 0
    with pytest.raises(NonFiniteHeldOutLoss) as err:
        evaluation.after_step(6)
    assert "(the weights give non-finite losses): check model.init_std" in str(err.value)


def test_an_evaluation_with_nothing_measured_tells_no_callback(monkeypatch):
    """No held-out split and no downstream task: the record would hold only the step, so no on_eval is sent."""
    dispatched = []
    trainer = SimpleNamespace(model=None, config=None, device=None, mesh=None,
                              dispatch=lambda *args: dispatched.append(args))
    evaluation = Evaluation(trainer)
    evaluation.heldout_loss = lambda: None
    downstream = {}
    monkeypatch.setattr("optimus.train.callbacks.evaluation.downstream_accuracies", lambda *args: downstream or None)
    assert evaluation.run(4) is None and dispatched == []
    downstream["arc_easy"] = {"acc": 0.5}
    evaluation.run(6)
    assert dispatched == [("on_eval", 6, {"step": 6, "downstream": {"arc_easy": {"acc": 0.5}}})]
