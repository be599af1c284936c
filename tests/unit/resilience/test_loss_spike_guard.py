"""LossSpikeGuard and ConsecutiveSkips: when a loss is a spike, what the statistics keep, exact resume."""

from __future__ import annotations

import math

import pytest

from optimus.resilience.guards import MIN_STEPS_TO_JUDGE, ConsecutiveSkips, LossSpikeGuard, TooManySkippedSteps

STEADY = [3.0, 3.1, 2.9, 3.05, 2.95, 3.0, 3.1, 2.9, 3.0, 3.02]


def test_no_decision_before_the_window_holds_enough_steps():
    guard = LossSpikeGuard(zscore=3.0, window=20)
    for loss in [3.0] * (MIN_STEPS_TO_JUDGE - 1):
        assert not guard(loss)
    assert not guard(1000.0)  # the 8th loss: still too few before it to judge, so it is accepted
    assert len(guard.losses) == MIN_STEPS_TO_JUDGE


def test_a_spike_is_skipped_and_left_out_of_the_statistics():
    guard = LossSpikeGuard(zscore=3.0, window=20)
    for loss in STEADY:
        assert not guard(loss)
    before = list(guard.losses)
    assert guard(50.0)
    assert guard(50.0)  # still a spike: the first one did not raise the threshold
    assert list(guard.losses) == before
    assert not guard(3.05)  # an ordinary loss after the spikes is accepted again
    assert list(guard.losses) == [*before, 3.05]


def test_losses_below_the_threshold_are_not_spikes_and_the_window_slides():
    guard = LossSpikeGuard(zscore=3.0, window=8)
    for loss in STEADY:
        assert not guard(loss)
    assert list(guard.losses) == STEADY[-8:]
    assert not guard(0.1)  # a sudden drop is no spike
    assert math.isfinite(guard.threshold())


def test_state_dict_round_trip_gives_identical_decisions():
    guard = LossSpikeGuard(zscore=2.0, window=12)
    for loss in STEADY:
        guard(loss)
    restored = LossSpikeGuard(zscore=2.0, window=12)
    restored.load_state_dict(guard.state_dict())
    assert list(restored.losses) == list(guard.losses)  # float64 keeps Python floats exactly
    probes = [3.1, 3.4, 2.8, 3.35, 9.0, 3.0, 3.3, 3.25]
    assert [restored(x) for x in probes] == [guard(x) for x in probes]
    assert restored.threshold() == guard.threshold()


def test_a_fresh_guard_round_trips_empty():
    restored = LossSpikeGuard(zscore=2.0, window=12)
    restored.load_state_dict(LossSpikeGuard(zscore=2.0, window=12).state_dict())
    assert len(restored.losses) == 0 and restored.threshold() == math.inf


def test_consecutive_skips_stop_at_the_limit_with_step_reason_and_fix():
    skips = ConsecutiveSkips(limit=3)
    skips.update(1, "loss spike")
    skips.update(2, None)  # an applied step resets the count
    skips.update(3, "non-finite")
    skips.update(4, "loss spike")
    with pytest.raises(TooManySkippedSteps) as err:
        skips.update(5, "loss spike", "loss 40 vs 3 +- 0.1 over the last 8 accepted steps")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("step 5: 3 optimizer steps in a row were skipped (last: loss spike, loss 40")
    for fix in ("optim.lr", "earlier checkpoint", "resilience.spike_zscore"):
        assert fix in message


def test_consecutive_skips_count_survives_a_state_dict_round_trip():
    skips = ConsecutiveSkips(limit=3)
    skips.update(1, "non-finite")
    skips.update(2, "non-finite")
    restored = ConsecutiveSkips(limit=3)
    restored.load_state_dict(skips.state_dict())
    with pytest.raises(TooManySkippedSteps, match="step 3: 3 optimizer steps"):
        restored.update(3, "non-finite")


def test_a_loss_equal_to_flat_losses_is_not_a_spike():
    """Perfectly flat losses (a std of 0) put the threshold at their mean: the same loss again is accepted, only a
    higher one is a spike."""
    guard = LossSpikeGuard(zscore=3.0, window=8)
    for _ in range(8):
        assert not guard(2.5)
    assert guard.threshold() == 2.5
    assert not guard.is_spike(2.5) and guard.is_spike(2.5000001)
    assert not guard(2.5) and len(guard.losses) == 8


def test_a_zscore_of_zero_is_refused():
    with pytest.raises(ValueError, match="zscore > 0 and window >= 1, got 0"):
        LossSpikeGuard(zscore=0.0, window=8)


def test_a_window_smaller_than_the_minimum_judges_once_it_is_full():
    guard = LossSpikeGuard(zscore=3.0, window=3)
    for loss in (3.0, 3.1, 2.9):
        assert not guard(loss)
    assert guard.ready and guard(50.0)


def test_non_finite_losses_never_join_the_statistics():
    guard = LossSpikeGuard(zscore=3.0, window=20)
    for loss in (math.nan, math.inf):  # before the guard can judge: not spikes, yet not kept
        assert not guard(loss)
    for loss in STEADY:
        guard(loss)
    assert not guard(math.nan)
    assert list(guard.losses) == STEADY


def test_the_threshold_uses_the_population_std_of_the_accepted_losses():
    guard = LossSpikeGuard(zscore=2.0, window=8)
    for loss in (1.0, 3.0) * 4:
        guard(loss)
    assert guard.threshold() == 4.0  # mean 2 + 2 x std 1
    assert guard.describe(5.0) == "loss 5 vs 2 +- 1 over the last 8 accepted steps"


def test_a_skip_without_detail_names_only_its_reason():
    with pytest.raises(TooManySkippedSteps, match=r"^step 7: 1 optimizer steps in a row were skipped \(last: nan\): "):
        ConsecutiveSkips(limit=1).update(7, "nan")
