"""Bad `optimus plan` input refused in one line that names it: device counts, --efficiency, a cluster file's efficiency
keys, and a `base:` file's device the hardware table lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from optimus.config import ConfigError, load_config
from optimus.parallel.validate import divisors as _divisors
from optimus.plan.cluster import load_cluster
from optimus.plan.search import MAX_DEVICES, plan

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "mula-tiny-moe.yaml"


def _file(tmp_path, content: dict) -> str:
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(content))
    return str(path)


def test_divisors_are_every_divisor_in_order():
    for n in (1, 2, 12, 16, 36, 97, 1000):
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    # a count the old range(1, n + 1) scan took minutes over: 2^3 * 5^9 has 40 divisors
    assert len(_divisors(15_625_000)) == 40 and _divisors(1_000_000_007) == [1, 1_000_000_007]


@pytest.mark.parametrize("devices, message", [
    (0, "--devices must be at least 1 (got 0)"),
    (-8, "--devices must be at least 1 (got -8)"),
    (1_000_000_000, f"--devices 1000000000 is more than the {MAX_DEVICES:,} devices the planner searches"),
    (7, "--devices 7 is not a multiple of the 8 devices per h100 node"),
])
def test_device_counts_that_cannot_be_planned_are_one_line(devices, message):
    with pytest.raises(ConfigError) as err:
        plan(load_config(CONFIG), load_cluster("h100"), devices)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_plan_cli_refuses_a_negative_device_count_with_exit_2(tmp_path, capsys, monkeypatch):
    from optimus.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(CONFIG), "--cluster", "h100", "--devices", "-8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--devices must be at least 1 (got -8)" in err and "multiple" not in err


def test_an_unknown_efficiency_key_is_named(tmp_path):
    path = _file(tmp_path, {"base": "h100", "efficiency": {"dense_gemm": 0.7, "bogus_class": 0.5}})
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    message = str(err.value)
    assert message.startswith(f"cluster file {path}: unknown efficiency key 'bogus_class': the keys are attention,")
    assert "\n" not in message


def test_a_based_file_with_an_unknown_device_names_the_file_not_the_preset(tmp_path):
    path = _file(tmp_path, {"base": "h100", "device": "TPUv9"})
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    message = str(err.value)
    assert message.startswith(f"cluster file {path} names device 'TPUv9', which has no entry")
    assert "'h100'" not in message
    # with its peaks given, the same device is priced at them
    priced = {"base": "h100", "device": "TPUv9", "peak_tflops": {"bf16": 900, "fp32": 90}}
    cluster = load_cluster(_file(tmp_path, priced))
    assert cluster.peak_flops("bf16") == 900e12



class _Searched(Exception):
    """Raised by the stand-in search: the flags were accepted."""


def _record_the_search(monkeypatch) -> list:
    """Replace the layout search by a stand-in that records the efficiency it was given and stops the command."""
    given = []

    def search(config, cluster, devices, efficiency, only, routing):
        given.append(efficiency)
        raise _Searched

    monkeypatch.setattr("optimus.plan.search.plan", search)
    return given


@pytest.mark.parametrize("efficiency", ["1", "0.5"])
def test_an_efficiency_up_to_one_reaches_the_search(efficiency, monkeypatch):
    """--efficiency takes (0, 1]: 1 (the peak) is a legal what-if, priced with every compute class at that value."""
    from optimus.cli import main

    given = _record_the_search(monkeypatch)
    with pytest.raises(_Searched):
        main(["plan", str(CONFIG), "--cluster", "h100", "--devices", "8", "--efficiency", efficiency])
    assert (given[0].dense_gemm, given[0].attention) == (float(efficiency), float(efficiency))


@pytest.mark.parametrize("efficiency", ["1.01", "0", "-0.5"])
def test_an_efficiency_outside_zero_to_one_is_one_line(efficiency, monkeypatch, capsys):
    """More than the peak, or nothing, cannot be priced: one line naming the flag, before any search."""
    from optimus.cli import main

    given = _record_the_search(monkeypatch)
    assert main(["plan", str(CONFIG), "--cluster", "h100", "--devices", "8", "--efficiency", efficiency]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--efficiency must be in (0, 1] (got {float(efficiency):g})" in err
    assert given == []
