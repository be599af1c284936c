"""The collectives `optimus plan --calibrate` times on forked gloo ranks, the cores' share each rank gets, and the
alpha-beta fit of comms.py's ring formulas to them."""

from __future__ import annotations

import pytest

from optimus.plan.calibrate_collectives import COLLECTIVE_TIMING, COLLECTIVES, fit_alpha_beta


def test_least_squares_recovers_alpha_and_beta_of_the_ring_model():
    alpha, beta = 150e-6, 0.8e9
    rows = []
    for g in (2, 4):
        for nbytes in (4096, 65536, 1 << 20, 8 << 20):
            for op in COLLECTIVES:
                factor = 2 if op == "all_reduce" else 1
                seconds = factor * ((g - 1) * alpha + (g - 1) / g * nbytes / beta)
                noisy = seconds * (1.03 if nbytes == 4096 else 1)
                rows.append({"op": op, "ranks": g, "bytes": nbytes, "seconds": noisy})
    fit = fit_alpha_beta(rows)
    assert fit["alpha_us"] == pytest.approx(150, rel=0.05)
    assert fit["beta_gb_s"] == pytest.approx(0.8, rel=0.05)
    assert 0.0 < fit["worst_relative_error"] < 0.05


def test_share_is_measured_with_forked_processes_running_at_once():
    from optimus.plan.calibrate_collectives import measure_share

    shares = measure_share(worlds=(2,), seconds=0.1, samples=1)
    assert set(shares) == {"1", "2"} and all(0 < v <= 1 for v in shares.values())


def test_share_never_exceeds_what_the_cores_allow(monkeypatch):
    """A disturbed single-rank sample inflates the ratio (4 ranks on 2 cores read 0.72 once): the share is capped
    at cores / ranks."""
    from optimus.plan import calibrate_collectives

    monkeypatch.setattr(calibrate_collectives, "sustained_matmul_rate", lambda seconds: 1.0)
    monkeypatch.setattr(calibrate_collectives, "run_on_local_ranks", lambda fn, world, seconds, timeout: [0.72] * world)
    monkeypatch.setattr(calibrate_collectives.os, "sched_getaffinity", lambda pid: {0, 1})
    shares = calibrate_collectives.measure_share((2, 4), seconds=0.0, samples=1)
    assert shares == {"2": 0.72, "4": 0.5, "1": 1.0}


def test_collectives_are_timed_in_bursts_of_back_to_back_calls(tmp_path, monkeypatch):
    import uuid

    from optimus.plan.calibrate_collectives import burst_calls, measure_collectives
    from optimus.train import host_memory

    # each timed rank (forked: the patch is inherited) keeps freed memory for reuse, as a training process does
    monkeypatch.setattr(host_memory, "reuse_freed_host_memory", lambda: (tmp_path / uuid.uuid4().hex).touch())
    assert burst_calls(4096) == 8 and burst_calls(8 << 20) == 4 and burst_calls(64 << 20) == 2
    table = measure_collectives(worlds=(2,), sizes=(4096,), repeats=2, subgroups=((2, 4, "collectives"),
                                                                                   (2, 4, "compute")), sync_samples=1)
    assert table["timing"] == COLLECTIVE_TIMING and set(table["fits"]) == {"2"}
    # and what a call reached after 10 and 40 ms of compute costs beyond a back-to-back one, per job size
    assert set(table["sync_after_compute"]) == {"2"}
    assert [chunk for chunk, _ in table["sync_after_compute"]["2"]] == [0.01, 0.04]
    assert all(extra >= 0 for _, extra in table["sync_after_compute"]["2"])
    whole = [r for r in table["rows"] if "job" not in r]
    assert {r["op"] for r in whole} == set(COLLECTIVES) and all(r["ranks"] == 2 for r in whole)
    for others in ("collectives", "compute"):  # the two pairs of a 4-rank job at once; one while the other computes
        pairs = [r for r in table["rows"] if r.get("others") == others]
        assert {r["op"] for r in pairs} == set(COLLECTIVES) and all(r["ranks"] == 2 and r["job"] == 4 for r in pairs)
    assert all(r["seconds"] > 0 for r in table["rows"])
    assert len(list(tmp_path.iterdir())) == 2 + 4 + 4  # every rank of the job of 2 and of both 4-rank jobs


def test_a_lone_ranks_share_is_capped_at_a_whole_core(monkeypatch):
    """The one-rank share compares a second matmul sample with the first: a faster second sample (the first
    disturbed) still gives one rank at most its whole core, 1.0."""
    from optimus.plan import calibrate_collectives

    rates = iter([1.0, 1.5])
    monkeypatch.setattr(calibrate_collectives, "sustained_matmul_rate", lambda seconds: next(rates))
    monkeypatch.setattr(calibrate_collectives.os, "sched_getaffinity", lambda pid: {0, 1})
    assert calibrate_collectives.measure_share((), seconds=0.0, samples=1) == {"1": 1.0}


def test_a_fit_without_latency_keeps_alpha_at_its_floor_of_a_tenth_of_a_microsecond():
    """Rows that follow the ring model with no latency at all fit alpha to zero, which the fit floors at 0.1 us
    (1e-7 s, so that no collective is priced free or negative), and recover beta."""
    rows = [{"op": op, "ranks": g, "bytes": nbytes,
             "seconds": (2 if op == "all_reduce" else 1) * (g - 1) / g * nbytes / 1e9}
            for g in (2, 4) for nbytes in (4096, 1 << 20) for op in COLLECTIVES]
    fit = fit_alpha_beta(rows)
    assert fit["alpha_us"] == pytest.approx(0.1) and fit["beta_gb_s"] == pytest.approx(1.0, rel=1e-3)


def test_a_message_smaller_than_the_group_still_moves_an_element_a_rank():
    """Each timed message holds at least one element per member (a 4-byte size over a pair: 2 elements, 8 bytes),
    so no collective is timed empty."""
    from optimus.parallel.local_ranks import run_on_local_ranks
    from optimus.plan.calibrate_collectives import _time_collectives

    rows = run_on_local_ranks(_time_collectives, 2, (4,), 1, timeout=120.0)[0]
    assert {r["op"] for r in rows} == set(COLLECTIVES) and all(r["bytes"] == 8 for r in rows)


def test_the_fits_worst_relative_error_is_its_largest_over_the_rows():
    """worst_relative_error: the largest |predicted - measured| / measured over the rows, predicted by the ring
    model (g - 1) alpha + (g - 1) / g x S / beta (twice that for all-reduce) at the fitted alpha and beta."""
    rows = [{"op": op, "ranks": g, "bytes": nbytes, "seconds": (2 if op == "all_reduce" else 1) *
             ((g - 1) * 1e-4 + (g - 1) / g * nbytes / 1e9) * (1.2 if nbytes == 4096 and g == 2 else 1)}
            for g in (2, 4) for nbytes in (4096, 1 << 20, 8 << 20) for op in COLLECTIVES]
    fit = fit_alpha_beta(rows)
    alpha, beta = fit["alpha_us"] * 1e-6, fit["beta_gb_s"] * 1e9
    errors = [abs((2 if r["op"] == "all_reduce" else 1) * ((r["ranks"] - 1) * alpha + (r["ranks"] - 1) / r["ranks"] *
                                                            r["bytes"] / beta) - r["seconds"]) / r["seconds"]
              for r in rows]
    assert fit["worst_relative_error"] == pytest.approx(max(errors)) and max(errors) > 2 * min(errors)
