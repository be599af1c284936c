"""train_step names its phases for profilers (benchmarks/step_profile.py splits the GPU's idle time by them)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from optimus.models.transformer import build_model
from optimus.optim.build import build_optimizer
from optimus.train.step import train_step
from tests.helpers.parity import tiny_config


def test_a_profiled_step_shows_its_three_phases_once_each():
    config = tiny_config(moe=True)
    model = build_model(config.model, device=torch.device("cpu"), seed=0)
    optimizer = build_optimizer(model, config.optim)
    tokens = torch.randint(0, config.model.vocab_size, (2, config.train.seq_len + 1))
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        train_step(model, optimizer, [(tokens[:, :-1], tokens[:, 1:])], device=torch.device("cpu"), grad_clip=1.0)
    names = [e.name for e in profiler.events() if e.name.startswith("optimus.")]
    assert sorted(names) == ["optimus.clip_gradients", "optimus.forward_backward", "optimus.optimizer_step"]
