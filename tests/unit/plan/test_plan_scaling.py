"""`optimus plan --scaling-from M [--scaling weak]`: each layout's scaling efficiency against a smaller run's best."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from optimus.cli import main
from optimus.config import ConfigError, load_config
from optimus.plan.report import describe_scaling
from optimus.plan.scaling import SmallerRun, smaller_config
from tests.helpers.runs import one_error_line

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MOE = CONFIGS / "mula-tiny-moe.yaml"  # global batch 8
PLAN = ["plan", str(MOE), "--cluster", "h100", "--top", "1"]


def _plan(tmp_path: Path, name: str, *flags: str) -> list[dict]:
    out = tmp_path / f"{name}.json"
    assert main([*PLAN, *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _per_device(entry: dict, devices: int) -> float:
    return entry["tokens_per_s"] / devices


@pytest.mark.parametrize("scaling, smaller_batch", [("strong", 8), ("weak", 4)])
def test_every_layout_is_scored_against_the_smaller_runs_best(tmp_path, capsys, scaling, smaller_batch):
    """Strong scaling keeps the global batch of 8 on the 8 devices, weak gives them 4 (as many per device): the
    baseline is what `optimus plan --devices 8` ranks first at that batch."""
    big = _plan(tmp_path, "big", "--devices", "16", "--scaling-from", "8", "--scaling", scaling)
    said = capsys.readouterr().out
    small = _plan(tmp_path, "small", "--devices", "8", f"--train.global_batch_size={smaller_batch}")
    baseline = next(e for e in small if e["fits"])
    for entry in big:
        assert entry["scaling_efficiency"] == pytest.approx(_per_device(entry, 16) / _per_device(baseline, 8))
    assert (f"{scaling} scaling from 8 to 16 devices: {big[0]['scaling_efficiency']:.1%} of linear" in said and
            f"{smaller_batch} sequences on 8" in said)


def test_the_smaller_run_keeps_or_scales_the_batch():
    config = load_config(MOE, [])
    assert smaller_config(config, 16, 8, "strong") is config
    assert smaller_config(config, 16, 8, "weak").train.global_batch_size == 4
    assert smaller_config(config, 16, 8, "weak").model == config.model
    with pytest.raises(ConfigError, match="train.global_batch_size 8 x 8 / 24 is not a whole number of sequences"):
        smaller_config(config, 24, 8, "weak")
    with pytest.raises(ConfigError, match="needs between 1 and 15 devices"):
        smaller_config(config, 16, 16, "strong")


def test_a_smaller_run_that_fits_nowhere_is_said_not_scored():
    line = describe_scaling(SmallerRun(8, "strong", 3072, None), best=None, devices=64)
    assert line == ("scaling: no layout of 8 devices fits (global batch held at 3072 sequences): no smaller run to "
                    "compare with")
    unfit = SimpleNamespace(fits=False)
    assert describe_scaling(SmallerRun(8, "strong", 3072, unfit), best=unfit, devices=64) == (
        "scaling: no layout of 64 devices fits: none to score against a smaller run")


@pytest.mark.parametrize("flags, message", [
    (["--devices", "16", "--scaling", "weak"], "--scaling weak says how to scale from a smaller run: give its "
                                               "devices with --scaling-from M"),
    (["--devices", "16", "--scaling-from", "16"], "--scaling-from 16: the smaller run needs between 1 and 15 devices"),
    (["--devices", "16", "--scaling-from", "4"], "--scaling-from 4 is not a multiple of the 8 devices per h100 node"),
    (["--devices", "24", "--scaling-from", "8", "--scaling", "weak"], "is not a whole number of sequences"),
    # one node has no smaller whole-node run: the fix named, not a range of device counts none of which works
    (["--devices", "8", "--scaling-from", "4"], "--devices 8 is at most one node of 8; plan at least 2 nodes (16 "
                                                "devices) or drop --scaling-from"),
])
def test_plan_refuses_a_smaller_run_it_cannot_compare_in_one_line(flags, message, capsys, monkeypatch):
    monkeypatch.setattr("optimus.plan.search.plan", lambda *a, **k: pytest.fail("searched before the flags held"))
    assert main([*PLAN, *flags]) == 2
    assert message in one_error_line(capsys)


def test_the_baseline_is_the_smaller_runs_best_fitting_layout_not_its_fastest(monkeypatch):
    """A layout that does not fit never ran: scoring against it would make every larger layout look inefficient. The
    smaller run is planned at its own devices and batch (weak: 8 x 8 / 16 = 4 sequences)."""
    from optimus.plan import scaling

    unfit, fits = SimpleNamespace(fits=False, tokens_per_s=9e9), SimpleNamespace(fits=True, tokens_per_s=1e6)
    planned = []

    def plan(config, cluster, devices, *rest):
        planned.append((config.train.global_batch_size, devices))
        return [unfit, fits] if len(planned) == 1 else [unfit]

    monkeypatch.setattr(scaling, "plan", plan)
    config = load_config(MOE, [])
    baseline = scaling.smaller_run(config, None, 16, 8, "weak")
    assert (baseline.best, baseline.devices, baseline.global_batch_size) == (fits, 8, 4)
    assert baseline.efficiency(SimpleNamespace(tokens_per_s=3e6), 16) == pytest.approx(3e6 / 16 / (1e6 / 8))
    assert scaling.smaller_run(config, None, 16, 8, "strong").best is None  # none fits: no baseline
    assert planned == [(4, 8), (8, 8)]


def test_the_smaller_run_is_priced_at_the_same_routing_and_restrictions(monkeypatch):
    """--moe-imbalance (or a run's routing) and --only hold for the smaller run as for the larger: the baseline is
    the same job on fewer devices."""
    from optimus.plan import scaling

    seen = []

    def plan(config, cluster, devices, efficiency, only, routing):
        seen.append((devices, efficiency, only, routing))
        return [SimpleNamespace(fits=True, tokens_per_s=1e6)]

    monkeypatch.setattr(scaling, "plan", plan)
    only = {"tp": frozenset({"1"})}
    scaling.smaller_run(load_config(MOE, []), None, 16, 8, "strong", "efficiency", only, 1.5)
    assert seen == [(8, "efficiency", only, 1.5)]
