"""Cluster files a user writes for a machine without a preset (optimus/plan/cluster.py load_cluster): read with a
preset's keys, `base:` to change one, `peak_tflops` for a device the hardware table lacks, and every value checked."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from optimus.config import ConfigError
from optimus.plan.cluster import is_cluster_file, load_cluster
from optimus.plan.efficiency import Efficiency
from optimus.plan.search import plan

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
OWN_DEVICE = {"name": "mi355", "device": "MI355X", "devices_per_node": 8, "memory_gb": 288, "hbm_gb_s": 8000,
              "intra_node_gb_s": 76.8, "intra_node_latency_us": 3, "inter_node_gb_s": 400, "nics_per_node": 8,
              "inter_node_latency_us": 8, "node_power_kw": 14, "pue": 1.2, "grid_kgco2_per_kwh": 0.3,
              "peak_tflops": {"bf16": 2500, "fp32": 157}}


def _file(tmp_path, content: dict, name: str = "mine.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(content))
    return str(path)


def test_a_file_of_a_presets_keys_is_a_cluster_priced_at_its_own_peaks(tmp_path):
    cluster = load_cluster(_file(tmp_path, OWN_DEVICE))
    assert (cluster.name, cluster.devices_per_node, cluster.memory_gb, cluster.pue) == ("mi355", 8, 288.0, 1.2)
    assert cluster.peak_flops("bf16") == 2500e12 and cluster.peak_flops("fp32") == 157e12
    assert cluster.efficiency == Efficiency()  # no efficiency block: the defaults


def test_base_takes_a_preset_and_changes_only_what_the_file_gives(tmp_path):
    h100 = load_cluster("h100")
    mine = load_cluster(_file(tmp_path, {"base": "h100", "name": "h100x4", "devices_per_node": 4,
                                         "inter_node_gb_s": 50, "nics_per_node": 2,
                                         "efficiency": {"dense_gemm": 0.7}}))
    assert mine == replace(h100, name="h100x4", devices_per_node=4, inter_node_gb_s=50.0, nics_per_node=2,
                           efficiency=replace(h100.efficiency, dense_gemm=0.7))


def test_a_cluster_file_plans_and_its_numbers_move_the_plan(tmp_path):
    from optimus.config import load_config

    config = load_config(CONFIGS / "mula-tiny-moe.yaml")
    fast = plan(config, load_cluster(_file(tmp_path, OWN_DEVICE)), 8)[0]
    slow_device = {**OWN_DEVICE, "peak_tflops": {"bf16": 250, "fp32": 15.7}, "hbm_gb_s": 800}
    slow = plan(config, load_cluster(_file(tmp_path, slow_device, "slow.yaml")), 8)[0]
    assert fast.fits and slow.step_s > 2 * fast.step_s


@pytest.mark.parametrize("change, message", [
    ({"hbm_gb_s": -8000}, "hbm_gb_s must be a positive number (got -8000)"),
    ({"hbm_gb_s": "fast"}, "hbm_gb_s must be a positive number (got 'fast')"),
    ({"inter_node_latency_us": float("nan")}, "inter_node_latency_us must be a number, 0 or more"),
    ({"pue": 0.9}, "pue must be at least 1"),
    ({"node_power_kw": 0}, "node_power_kw must be a positive number (got 0)"),  # a plan of no energy
    ({"grid_kgco2_per_kwh": -0.1}, "grid_kgco2_per_kwh must be a number, 0 or more (got -0.1)"),
    ({"devices_per_node": 2.5}, "devices_per_node must be a whole number, at least 1 (got 2.5)"),
    ({"devices_per_node": True}, "devices_per_node must be a whole number"),
    ({"speed": 3}, "unknown key 'speed': a cluster takes name, device"),
    ({"pue": None, "node_power_kw": None}, "missing node_power_kw, pue: add them"),
    ({"peak_tflops": {"bf16": 2500}}, "peak_tflops must be {bf16: TFLOPS, fp32: TFLOPS}"),
    ({"peak_tflops": {"bf16": float("inf"), "fp32": 80}}, "peak_tflops must be {bf16: TFLOPS, fp32: TFLOPS}"),
    ({"peak_tflops": None}, "names device 'MI355X', which has no entry"),
    ({"efficiency": {"dense_gemm": 1.5}}, "efficiency dense_gemm=1.5 is out of range"),
    ({"efficiency": {"dense_gemm": "abc"}}, "efficiency dense_gemm must be a finite number (got 'abc')"),
    ({"efficiency": {"dense_gemm": True}}, "efficiency dense_gemm must be a finite number (got True)"),
    ({"efficiency": {"op_overhead_us": float("nan")}}, "efficiency op_overhead_us must be a finite number (got nan)"),
    ({"efficiency": {"eager_memory_traffic": float("inf")}},
     "efficiency eager_memory_traffic must be a finite number (got inf)"),
    ({"name": ""}, "name must be a name"),
])
def test_a_bad_value_is_one_line_naming_the_file_and_the_key(tmp_path, change, message):
    content = {k: v for k, v in {**OWN_DEVICE, **change}.items() if v is not None}
    path = _file(tmp_path, content)
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert message in str(err.value) and "\n" not in str(err.value)
    if "names device" not in message:
        assert str(err.value).startswith(f"cluster file {path}:")


def test_an_unreadable_or_unknown_file_or_base_is_one_line(tmp_path):
    (tmp_path / "broken.yaml").write_text("name: [1, 2\n")
    (tmp_path / "list.yaml").write_text("- a\n")
    cases = {str(tmp_path / "nope.yaml"): "not found: pass a preset (a100, aurora",
             str(tmp_path / "broken.yaml"): "is not valid YAML at line 2",
             str(tmp_path / "list.yaml"): "must hold a mapping of a preset's keys",
             _file(tmp_path, {"base": "summit", "name": "x"}, "base.yaml"): "base 'summit' is not a preset",
             _file(tmp_path, {"base": "h100", "efficiency": [0.5]}, "eff.yaml"): "efficiency must be a mapping"}
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_cluster(path)


def test_a_cluster_file_that_is_not_utf8_text_is_one_line(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0\)") as err:
        load_cluster(str(path))
    assert str(err.value).startswith(f"cluster file {path} ") and "\n" not in str(err.value)


def test_a_name_is_a_preset_and_a_path_or_yaml_name_is_a_file():
    assert not is_cluster_file("h100") and not is_cluster_file("here") and not is_cluster_file("summit")
    assert is_cluster_file("mine.yaml") and is_cluster_file("clusters/mine") and is_cluster_file("x.yml")


def test_a_presets_name_wins_over_a_file_of_that_name_here(tmp_path, monkeypatch):
    """`--cluster h100` is the preset even where the working folder holds a file called h100; a file without a
    .yaml name that is not a preset's is read as a cluster file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h100").write_text(yaml.safe_dump({**OWN_DEVICE, "name": "not-the-preset"}))
    (tmp_path / "mine").write_text(yaml.safe_dump(OWN_DEVICE))
    assert not is_cluster_file("h100") and load_cluster("h100").name == "h100"
    assert is_cluster_file("mine") and load_cluster("mine").name == "mi355"


def test_whole_counts_written_with_a_decimal_point_are_read_as_integers(tmp_path):
    """`devices_per_node: 8.0` is 8 devices, an int as a preset's is (it sizes groups and prints in messages as 8),
    and every other number is read as a float."""
    cluster = load_cluster(_file(tmp_path, {**OWN_DEVICE, "devices_per_node": 8.0, "nics_per_node": 4.0}))
    assert (repr(cluster.devices_per_node), repr(cluster.nics_per_node)) == ("8", "4")
    assert all(type(getattr(cluster, key)) is float for key in ("memory_gb", "hbm_gb_s", "intra_node_latency_us"))


def test_a_folder_given_as_the_cluster_file_is_named_a_folder_not_missing(tmp_path):
    folder = tmp_path / "mine.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="cluster file '.*mine.yaml' is a directory: pass the path of a YAML file"):
        load_cluster(str(folder))
