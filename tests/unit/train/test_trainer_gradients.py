"""The Trainer frees a step's gradients as soon as the optimizer has used them: evaluation and checkpointing
between steps do not hold them (a whole set of fp32 gradients, zero1's whole compute-dtype ones)."""

from __future__ import annotations

from optimus.config import build_config
from optimus.train.callbacks.base import Callback
from optimus.train.trainer import Trainer
from tests.helpers.runs import tiny_run_config


class GradientsBetweenSteps(Callback):
    """Records, after each step and at each evaluation, how many parameters still hold a gradient."""

    def __init__(self):
        self.held: list[tuple[str, int, int]] = []

    def _count(self, when: str, step: int) -> None:
        model = self.trainer.model
        self.held.append((when, step, sum(p.grad is not None for p in model.parameters())))

    def after_step(self, step: int) -> None:
        self._count("after_step", step)

    def on_eval(self, step: int, record) -> None:
        self._count("eval", step)


def test_no_gradient_is_held_between_steps_or_during_evaluation(tmp_path, small_token_dir):
    probe = GradientsBetweenSteps()
    config = tiny_run_config(tmp_path, small_token_dir, train=dict(max_steps=3, eval_every=2, ckpt_every=2))
    trainer = Trainer(build_config(config), callbacks=[probe])
    probe.trainer = trainer
    trainer.fit()
    assert ("eval", 2, 0) in probe.held and ("after_step", 3, 0) in probe.held
    assert all(count == 0 for _, _, count in probe.held), probe.held
