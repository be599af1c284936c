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
