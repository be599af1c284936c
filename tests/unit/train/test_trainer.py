"""The Trainer's bookkeeping: step n trains at the schedule's learning rate of optimizer step n - 1 (the first step
at warm-up's first value), the optimizer holds that rate while it steps, tokens_seen adds up every step's tokens, and
a rerun of a finished run reports its held-out loss."""

from __future__ import annotations

import pytest
import torch

from optimus.config import build_config
from optimus.train.callbacks.base import Callback
from optimus.train.trainer import Trainer
from tests.helpers.runs import tiny_run_config


class StepProbe(Callback):
    """The optimizer's learning rates as each step starts (after the trainer set them), and each step's record."""

    def __init__(self):
        self.trainer = None
        self.rates: dict[int, set[float]] = {}
        self.records: dict[int, dict] = {}

    def on_step_start(self, step: int) -> None:
        self.rates[step] = {group["lr"] for group in self.trainer.optimizer.param_groups}

    def on_step_end(self, step: int, metrics: dict) -> None:
        self.records[step] = metrics


def test_each_step_trains_at_its_warmup_rate_and_counts_its_tokens(tmp_path, small_token_dir):
    """Linear warm-up over 4 steps to 1e-3: optimizer steps 1, 2, 3 run at 1/4, 2/4 and 3/4 of it (never at 0, nor
    a step ahead). Each step is one batch of 2 sequences of 32 tokens: 64 more tokens seen a step."""
    raw = tiny_run_config(tmp_path / "run", small_token_dir, train=dict(max_steps=3, log_every=1, eval_every=0))
    raw["optim"] = dict(lr=1e-3, warmup_steps=4, schedule="constant")
    probe = StepProbe()
    trainer = Trainer(build_config(raw), callbacks=[probe], progress_bar=False)
    probe.trainer = trainer
    trainer.fit()
    want = {1: 2.5e-4, 2: 5e-4, 3: 7.5e-4}
    assert sorted(probe.rates) == [1, 2, 3]
    for step, lr in want.items():
        (rate,) = probe.rates[step]  # one rate for every parameter group
        assert rate == pytest.approx(lr), step
    assert {step: record["lr"] for step, record in probe.records.items()} == pytest.approx(want)
    assert [probe.records[step]["tokens_seen"] for step in (1, 2, 3)] == [64, 128, 192]


def test_a_rerun_of_a_finished_run_trains_nothing_and_reports_the_same_held_out_loss(tmp_path, small_token_dir):
    raw = tiny_run_config(tmp_path / "run", small_token_dir, train=dict(max_steps=1))
    first = Trainer(build_config(raw), callbacks=[], progress_bar=False).fit()
    again = Trainer(build_config(raw), callbacks=[], progress_bar=False).fit()
    assert (again.step, again.resumed_from) == (1, 1)
    assert first.heldout_loss is not None and again.heldout_loss == pytest.approx(first.heldout_loss, rel=1e-6)


def test_a_resume_trains_with_this_runs_optimizer_settings_and_the_checkpoints_moments(tmp_path, small_token_dir):
    """A run resumed with another weight decay, betas or eps (the trainer says which changed) trains with those: the
    checkpoint brings each parameter's moments and step count, not the settings it was saved with. Loading alone
    restores the saved groups' settings (the checkpoint round-trips them exactly: test_safe_loading), so a changed
    weight decay was said and silently not applied."""
    raw = tiny_run_config(tmp_path / "run", small_token_dir, train=dict(max_steps=1))
    raw["optim"] = dict(weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)
    first = Trainer(build_config(raw), callbacks=[], progress_bar=False)
    first.fit()
    moments = {name: first.optimizer.state[param]["exp_avg"].clone() for name, param in first.model.named_parameters()}
    raw["train"]["max_steps"] = 2
    raw["optim"] = dict(weight_decay=0.2, betas=[0.8, 0.99], eps=1e-6)
    resumed = Trainer(build_config(raw), callbacks=[], progress_bar=False)
    resumed._restore()
    assert resumed.resume_step == 1
    assert sorted(group["weight_decay"] for group in resumed.optimizer.param_groups) == [0.0, 0.2]
    assert all(tuple(group["betas"]) == (0.8, 0.99) and group["eps"] == 1e-6
               for group in resumed.optimizer.param_groups)
    for name, param in resumed.model.named_parameters():  # and the moments are the checkpoint's
        assert torch.equal(resumed.optimizer.state[param]["exp_avg"], moments[name]), name
