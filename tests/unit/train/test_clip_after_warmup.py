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
