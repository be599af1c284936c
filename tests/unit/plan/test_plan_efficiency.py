"""The op classes' fractions of peak (optimus/plan/efficiency.py): their defaults, their ranges, and the one figure
`--efficiency` sets."""

from __future__ import annotations

import pytest

from optimus.plan.efficiency import DEFAULT_MEMORY_BOUND, OPTIMIZER_MAX, Efficiency


def test_without_their_own_figures_the_update_and_the_buffer_copies_run_at_the_memory_bound_fraction():
    """A preset or a calibration from before the optimizer and the copies were timed prices them as the other
    memory-bound work: its own memory_bound, not the default, and a timed optimizer leaves the copies alone."""
    older = Efficiency.from_dict({"memory_bound": 0.4}, "preset x")
    assert (older.optimizer, older.buffer_copy) == (0.4, 0.4)
    timed = Efficiency.from_dict({"memory_bound": 0.4, "optimizer": 2.0}, "preset x")
    assert (timed.optimizer, timed.buffer_copy) == (2.0, 0.4)
    assert Efficiency(memory_bound=0.3).buffer_copy == 0.3
    assert Efficiency.from_dict({}, "preset x").optimizer == DEFAULT_MEMORY_BOUND


@pytest.mark.parametrize("key", ["optimizer", "buffer_copy"])
def test_the_update_and_the_copies_may_beat_a_measured_copy_up_to_the_cap(key):
    """Both are read against a measured copy's bandwidth, which an in-place update or a cache-resident copy beats:
    up to OPTIMIZER_MAX (4) is a reading, above it a broken measurement."""
    assert getattr(Efficiency.from_dict({key: OPTIMIZER_MAX}, "x"), key) == OPTIMIZER_MAX
    with pytest.raises(ValueError, match=f"efficiency {key}=4.5 is out of range"):
        Efficiency.from_dict({key: 4.5}, "x")


@pytest.mark.parametrize("key", ["dense_gemm", "grouped_gemm", "attention", "loss_head", "memory_bound"])
def test_a_fraction_of_a_datasheet_peak_is_at_most_one(key):
    assert getattr(Efficiency.from_dict({key: 1}, "x"), key) == 1.0
    for value in (1.5, 0):
        with pytest.raises(ValueError, match=f"x: efficiency {key}={value:g} is out of range"):
            Efficiency.from_dict({key: value}, "x")


@pytest.mark.parametrize("key", ["op_overhead_us", "dtensor_overhead_us"])
def test_a_per_operator_cost_may_be_zero_but_not_negative(key):
    """Microseconds, not fractions: 0 is a GPU fed asynchronously (the presets' own value)."""
    assert getattr(Efficiency.from_dict({key: 0}, "x"), key) == 0.0
    assert getattr(Efficiency.from_dict({key: 150}, "x"), key) == 150.0
    with pytest.raises(ValueError, match=f"efficiency {key}=-1 is out of range"):
        Efficiency.from_dict({key: -1}, "x")


def test_the_efficiency_flag_sets_every_compute_class_and_no_memory_bound_one():
    """`--efficiency X` is one fraction of the FLOP/s peak: the GEMMs', attention's and the loss head's; the
    bandwidth-bound classes and the per-operator costs keep the preset's."""
    preset = Efficiency(0.8, 0.7, 0.6, 0.5, 20.0, loss_head=0.65, dtensor_overhead_us=3.0, optimizer=1.5,
                        eager_memory_traffic=1.7, buffer_copy=0.9)
    flagged = preset.with_gemm(0.4)
    assert (flagged.dense_gemm, flagged.grouped_gemm, flagged.attention, flagged.loss_head) == (0.4,) * 4
    assert ((flagged.memory_bound, flagged.op_overhead_us, flagged.dtensor_overhead_us, flagged.optimizer,
             flagged.eager_memory_traffic, flagged.buffer_copy) == (0.5, 20.0, 3.0, 1.5, 1.7, 0.9))
