import math

import pytest

from optimus.optim.config import OptimConfig
from optimus.optim.schedule import lr_at


def test_cosine_warmup_then_decay_to_min():
    config = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(0, 100, config) == pytest.approx(0.1)
    assert lr_at(9, 100, config) == pytest.approx(1.0)
    assert lr_at(99, 100, config) == pytest.approx(0.1, abs=1e-3)
    values = [lr_at(s, 100, config) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_is_flat_then_linear_decay():
    config = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, 100, config) == 1.0 and lr_at(79, 100, config) == 1.0
    assert lr_at(90, 100, config) == pytest.approx(0.5)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_warmup_climbs_to_the_peak_and_no_step_exceeds_it(schedule):
    config = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule=schedule, decay_fraction=0.2)
    values = [lr_at(step, 100, config) for step in range(100)]
    assert values[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert values[10] == pytest.approx(1.0) and max(values) == pytest.approx(1.0)


def test_wsd_decays_to_min_lr_not_to_zero():
    config = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=0, schedule="wsd", decay_fraction=0.2)
    assert lr_at(90, 100, config) == pytest.approx(0.55)
    assert lr_at(99, 100, config) == pytest.approx(0.1, abs=0.05) and lr_at(120, 100, config) == pytest.approx(0.1)


def test_cosine_is_half_way_at_the_middle_of_its_span_and_stays_at_the_floor_past_it():
    """By hand: warm-up 10 of 110 steps leaves a span of 100; step 60 is half way, cos(pi / 2) = 0, so the rate is
    min + (peak - min) / 2; past the last step it stays at min_lr (the cosine would climb back)."""
    config = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(60, 110, config) == pytest.approx(0.55, rel=1e-9)
    assert lr_at(35, 110, config) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)), rel=1e-9)
    assert lr_at(110, 110, config) == pytest.approx(0.1) and lr_at(150, 110, config) == pytest.approx(0.1)


def test_wsd_decays_over_the_floor_of_its_fraction_of_the_steps():
    """decay_fraction 0.27 of 10 steps: 2 decay steps (the floor of 2.7), from step 8; rounding would start at 7."""
    config = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=0, schedule="wsd", decay_fraction=0.27)
    assert [lr_at(step, 10, config) for step in (7, 8)] == [1.0, 1.0]
    assert lr_at(9, 10, config) == pytest.approx(1.0 + (0.1 - 1.0) / 2)


def test_a_constant_schedule_holds_the_peak_after_warm_up_to_the_last_step_and_past_it():
    """Not WSD's decay at the end (round 12's s07: a constant run fell through to the decay)."""
    config = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=2, schedule="constant", decay_fraction=0.2)
    assert [lr_at(step, 10, config) for step in (2, 8, 9, 10, 50)] == [1.0] * 5


def test_a_schedule_with_no_steps_after_warm_up_or_no_whole_decay_step_does_not_divide_by_zero():
    """All steps warm-up (cosine's span 0) and a decay fraction under one step (WSD's 0 decay steps): each is floored
    at one step (the decay starts at the last step and ends one past it), not a ZeroDivisionError."""
    cosine = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(10, 10, cosine) == 1.0 and lr_at(12, 10, cosine) == pytest.approx(0.1)
    wsd = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=0, schedule="wsd", decay_fraction=0.05)
    assert lr_at(9, 10, wsd) == 1.0 and lr_at(10, 10, wsd) == pytest.approx(0.1)


@pytest.mark.parametrize("settings", [{"lr": 0.0}, {"betas": (0.9, 1.0)}, {"betas": (-0.1, 0.9)},
                                      {"decay_fraction": 0.0}, {"decay_fraction": 1.01}, {"eps": 0.0},
                                      {"warmup_steps": -1}, {"weight_decay": -0.1}, {"grad_clip": -1.0}])
def test_optim_settings_out_of_range_are_refused(settings):
    with pytest.raises(ValueError):
        OptimConfig(**settings)


def test_optim_settings_at_their_allowed_edges_are_taken_and_the_defaults_are_the_documented_ones():
    """beta 0 (no momentum), a WSD that decays over every step, no clipping, no decay, no warm-up, a floor of 0."""
    config = OptimConfig(betas=(0.0, 0.0), decay_fraction=1.0, grad_clip=0.0, weight_decay=0.0, warmup_steps=0,
                         min_lr=0.0)
    assert config.decay_fraction == 1.0 and config.grad_clip == 0.0 and config.betas == (0.0, 0.0)
    default = OptimConfig()
    assert (default.lr, default.min_lr, default.warmup_steps, default.schedule) == (4e-4, 4e-5, 10, "cosine")
    assert (default.decay_fraction, default.weight_decay, default.betas, default.eps) == (0.2, 0.1, (0.9, 0.95), 1e-8)
    assert (default.grad_clip, default.clip_after_warmup) == (1.0, False)
