"""Learning-rate schedules: linear warm-up, then cosine, warmup-stable-decay (WSD) or constant."""

from __future__ import annotations

import math

from optimus.optim.config import OptimConfig


def lr_at(step: int, max_steps: int, config: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `max_steps`: a pure function, so resume is exact."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    if config.schedule == "cosine":
        span = max(1, max_steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, int(config.decay_fraction * max_steps))
    decay_start = max_steps - decay_steps
    if step < decay_start:
        return config.lr
    progress = min(1.0, (step - decay_start) / decay_steps)
    return config.lr + (config.min_lr - config.lr) * progress
