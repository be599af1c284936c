"""The op classes' fractions of peak (optimus/plan/efficiency.py): their defaults, their ranges, and the one figure
`--efficiency` sets."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("value", [float("nan"), float("inf"), None, "150"])
def test_a_cost_that_is_not_a_finite_number_is_refused_by_name(value):
    """A NaN passes `value < 0` and would price every layout at nan s a step; null or text would fail unnamed."""
    with pytest.raises(ValueError, match="x: efficiency op_overhead_us must be a finite number"):
        Efficiency.from_dict({"op_overhead_us": value}, "x")


def test_the_efficiency_flag_sets_every_compute_class_and_no_memory_bound_one():
    """`--efficiency X` is one fraction of the FLOP/s peak: the GEMMs', attention's and the loss head's; the
    bandwidth-bound classes and the per-operator costs keep the preset's."""
    preset = Efficiency(0.8, 0.7, 0.6, 0.5, 20.0, loss_head=0.65, dtensor_overhead_us=3.0, optimizer=1.5,
                        eager_memory_traffic=1.7, buffer_copy=0.9)
    flagged = preset.with_gemm(0.4)
    assert (flagged.dense_gemm, flagged.grouped_gemm, flagged.attention, flagged.loss_head) == (0.4,) * 4
    assert ((flagged.memory_bound, flagged.op_overhead_us, flagged.dtensor_overhead_us, flagged.optimizer,
             flagged.eager_memory_traffic, flagged.buffer_copy) == (0.5, 20.0, 3.0, 1.5, 1.7, 0.9))


H200_MULA_7B = {"dense_gemm": {2048: 0.598, 8192: 0.694, 16384: 0.734},  # stop 58's three calibrations
                "grouped_gemm": {256: 0.277, 1024: 0.479, 2048: 0.537}}


def test_a_rates_table_prices_each_call_at_its_rows_log_linearly_and_at_the_nearest_point_beyond():
    from optimus.plan.efficiency import call_rows

    e = Efficiency.from_dict({"dense_gemm": 0.6, "grouped_gemm": 0.3, "attention": 0.5, "by_rows": H200_MULA_7B}, "x")
    assert e.at_rows(call_rows(8192, 8, 64)).dense_gemm == 0.694  # a timed point
    assert e.at_rows(call_rows(4096, 8, 64)).dense_gemm == pytest.approx((0.598 + 0.694) / 2)  # halfway in log
    assert e.at_rows(call_rows(1024, 8, 64)).dense_gemm == 0.598  # below the table: its first point
    assert e.at_rows(call_rows(65536, 8, 64)).dense_gemm == 0.734  # beyond: its last
    # the experts by rows per expert: 4 x 2,048 tokens, top 8 of 64 experts, ep 2 -> 2,048 rows each
    assert call_rows(8192, 8, 64, ep=2)["grouped_gemm"] == 2048
    assert e.at_rows(call_rows(8192, 8, 64, ep=2)).grouped_gemm == 0.537
    assert e.at_rows(call_rows(8192, 8, 64)).attention == 0.5  # not tabulated: as given
    assert "grouped_gemm" not in call_rows(8192)  # a dense model has no expert rows


def test_a_rates_table_survives_the_calibration_cache_and_the_efficiency_flag_drops_it():
    e = Efficiency.from_dict({"by_rows": H200_MULA_7B}, "x")
    again = Efficiency.from_dict(json.loads(json.dumps(e.to_dict())), "x")  # JSON's keys are strings
    assert again == e and again.by_rows[0] == ("dense_gemm", ((2048.0, 0.598), (8192.0, 0.694), (16384.0, 0.734)))
    assert "by_rows" not in Efficiency().to_dict()  # what every preset and older cache writes, unchanged
    flagged = e.with_gemm(0.5)
    assert flagged.by_rows == () and flagged.at_rows({"dense_gemm": 2048.0}).dense_gemm == 0.5


@pytest.mark.parametrize("table, problem", [
    ({"memory_bound": {2048: 0.7}}, "by_rows has an unknown class 'memory_bound': the classes are dense_gemm"),
    ({"dense_gemm": {}}, "by_rows dense_gemm must map rows to fractions of peak"),
    ({"dense_gemm": 0.7}, "by_rows dense_gemm must map rows to fractions of peak"),
    ({"dense_gemm": {"many": 0.7}}, "by_rows dense_gemm must map rows to fractions of peak"),
    ({"dense_gemm": {2048: 1.2}}, "by_rows dense_gemm 2048: 1.2 is out of range"),
    ({"dense_gemm": {0: 0.5}}, "by_rows dense_gemm 0: 0.5 is out of range"),
    ([0.7], "by_rows must be a mapping of op class to {rows: fraction of peak}"),
])
def test_a_bad_rates_table_is_one_line_naming_the_file(table, problem):
    with pytest.raises(ValueError, match=f"^cluster file x.yaml: efficiency {problem}"):
        Efficiency.from_dict({"by_rows": table}, "cluster file x.yaml")
