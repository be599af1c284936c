"""optim.clip_after_warmup: no clipping while the learning rate warms up, the configured clip after."""

from __future__ import annotations

from optimus.config import build_config
from tests.helpers.runs import tiny_run_config
from optimus.train.trainer import Trainer


def test_clipping_starts_after_warmup(tmp_path, small_token_dir):
    raw = tiny_run_config(tmp_path / "run", small_token_dir)
    raw["optim"] = dict(warmup_steps=3, grad_clip=0.5, clip_after_warmup=True)
    trainer = Trainer(build_config(raw), progress_bar=False)
    assert [trainer.grad_clip_at(step) for step in (1, 2, 3, 4, 5)] == [0.0, 0.0, 0.0, 0.5, 0.5]
    raw["optim"]["clip_after_warmup"] = False
    assert Trainer(build_config(raw), progress_bar=False).grad_clip_at(1) == 0.5


def test_the_trainer_steps_with_the_threshold_of_each_step(tmp_path, small_token_dir, monkeypatch):
    """What fit() hands train_step, step by step: no clipping while warming up, then optim.grad_clip."""
    from optimus.train import trainer as trainer_module

    handed = []
    real_step = trainer_module.train_step

    def recording_step(*args, grad_clip, **kwargs):
        handed.append(grad_clip)
        return real_step(*args, grad_clip=grad_clip, **kwargs)

    monkeypatch.setattr(trainer_module, "train_step", recording_step)
    raw = tiny_run_config(tmp_path / "run", small_token_dir)
    raw["optim"] = dict(warmup_steps=2, grad_clip=0.5, clip_after_warmup=True)
    raw["train"] = {**raw["train"], "max_steps": 4}
    Trainer(build_config(raw), progress_bar=False).fit()
    assert handed == [0.0, 0.0, 0.5, 0.5]
