"""`optimus plan --calibrate --cluster NAME` on a node of NAME's accelerators (optimus/plan/calibrate_node.py).

There is no GPU here: the node's "devices" are CPU ranks (measure_node's device_type), which run every line the
GPU path runs but the device's own library, its synchronize and torch.compile's GPU kernels. What that yields is
checked as the planner reads it: the file it writes loads as a cluster, carries what was measured and the rest of
the preset, and plans.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from optimus.config import ConfigError, load_config
from optimus.plan import calibrate_node
from optimus.plan.calibrate_node import calibrated_cluster_text, check_devices, describe_node, measure_node
from optimus.plan.cluster import load_cluster
from optimus.plan.efficiency import Efficiency
from optimus.plan.search import plan
from optimus.train.hardware import LocalAccelerators
from tests.helpers.cli import run_in_process as _in_process

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
H100S = LocalAccelerators("cuda", "NVIDIA H100 80GB HBM3", 2, 79.19)
# a CPU's minute, not a GPU's: the table by rows at 1 and 4 sequences a micro-batch (and the config's own)
SMALL = {"sizes": (4096, 65536), "repeats": 3, "matmul_size": 256, "micro_batches": (1, 4)}


def _config(*overrides: str):
    return load_config(CONFIGS / "mula-tiny-moe.yaml",
                       ["--train.seq_len=64", "--train.micro_batch_size=2", "--train.dtype=fp32", *overrides])


def test_only_the_clusters_own_devices_are_calibrated():
    h100 = load_cluster("h100")
    with pytest.raises(ConfigError, match="torch sees no GPU or XPU here: run it on such a node, or give --cluster "
                                          "here to calibrate this CPU"):
        check_devices(h100, None, "h100")
    with pytest.raises(ConfigError, match="measures H100 devices, but this node has 8 AMD Instinct MI250X"):
        check_devices(h100, LocalAccelerators("cuda", "AMD Instinct MI250X", 8, 64.0), "h100")
    check_devices(h100, H100S, "h100")  # an H100 node: measured


@pytest.fixture(scope="module")
def measured():
    """One measurement of the tiny MoE on two CPU "devices", shared by the checks below."""
    return measure_node(_config(), load_cluster("h100"), H100S, compile_block=False, device_type="cpu", **SMALL)


def test_the_written_file_is_the_preset_with_what_the_node_measured(measured, tmp_path):
    h100 = load_cluster("h100")
    path = tmp_path / "node.yaml"
    calibrate_node.write_calibrated(path, calibrated_cluster_text(h100, measured, H100S, "the tiny MoE"))
    node = load_cluster(str(path))
    assert node.name == "h100-calibrated" and node.device == "H100"
    assert node.memory_gb == pytest.approx(79.19)  # the device's own report, not the datasheet's 80
    # the collectives over the node's 2 ranks, fitted to comms.py's ring: its alpha and beta
    link = measured["link"]
    assert len(link["rows"]) == 4 * len(SMALL["sizes"]) and {r["ranks"] for r in link["rows"]} == {2}
    assert node.intra_node_latency_us == pytest.approx(link["alpha_us"], rel=1e-3)
    assert node.intra_node_gb_s == pytest.approx(link["beta_gb_s"], rel=1e-3)
    # every op class measured (fractions of the H100's peaks: tiny on a CPU, but what was timed), to 4 digits
    for name, value in measured["efficiency"].items():
        if name != "by_rows":  # test_the_compute_classes_are_tabulated_by_the_rows_a_call_runs
            assert getattr(node.efficiency, name) == pytest.approx(value, rel=1e-3, abs=1e-12), name
    assert 0 < node.efficiency.dense_gemm < 0.05 and node.efficiency.op_overhead_us > 0
    assert node.efficiency.dtensor_overhead_us == 0  # not timed: an accelerator's host dispatches ahead
    assert node.efficiency.eager_memory_traffic == 1  # compile_block off: memory_bound is the eager block's
    for key in ("devices_per_node", "hbm_gb_s", "inter_node_gb_s", "nics_per_node", "inter_node_latency_us",
                "node_power_kw", "pue", "grid_kgco2_per_kwh"):
        assert getattr(node, key) == getattr(h100, key), key
    assert node.peak_flops("bf16") == h100.peak_flops("bf16")
    # and it plans: slower than the preset, every op class being far below the preset's
    config = _config()
    on_node, on_preset = plan(config, node, 8)[0], plan(config, h100, 8)[0]
    # the compute at a CPU's fractions of an H100's peak; the whole step's ratio depends on how fast this CPU is (8.8x
    # on an Intel Xeon with AMX, stop 60), its compute's does not
    assert on_node.step_s > on_preset.step_s and on_node.parts["compute"] > 10 * on_preset.parts["compute"]


def test_the_compute_classes_are_tabulated_by_the_rows_a_call_runs(measured, tmp_path):
    """At micro-batches 1 and 4 of the config's 64-token sequences (SMALL's; a node times 1, 2, 4 and 8), and its
    own, 2, which is the efficiency block's point: the projections, attention and loss head by tokens a micro-batch,
    the tiny MoE's experts (top 4 of 16, ep 1) by rows per expert; written, read back and priced at a layout's own
    rows."""
    table = measured["efficiency"]["by_rows"]
    assert set(table) == {"dense_gemm", "grouped_gemm", "attention", "loss_head"}
    for name in ("dense_gemm", "attention", "loss_head"):
        assert sorted(map(float, table[name])) == [64.0, 128.0, 256.0], name
    assert sorted(map(float, table["grouped_gemm"])) == [16.0, 32.0, 64.0]  # T x 4 / 16
    for name, points in table.items():
        assert {float(rows): value for rows, value in points.items()}[128.0 if name != "grouped_gemm" else 32.0] == \
            measured["efficiency"][name], name
        assert all(0 < value <= 1 for value in points.values()), name
    path = tmp_path / "node.yaml"
    calibrate_node.write_calibrated(path, calibrated_cluster_text(load_cluster("h100"), measured, H100S, "a test"))
    node = load_cluster(str(path)).efficiency
    read = dict(node.by_rows)
    for name, points in table.items():
        assert dict(read[name]) == pytest.approx({float(r): v for r, v in points.items()}, rel=1e-3), name
    from optimus.plan.efficiency import call_rows

    at_four = node.at_rows(call_rows(256, top_k=4, n_experts=16))
    assert at_four.dense_gemm == pytest.approx(dict(read["dense_gemm"])[256.0])
    assert at_four.grouped_gemm == pytest.approx(dict(read["grouped_gemm"])[64.0])


def test_the_table_ends_at_the_first_micro_batch_the_device_has_no_memory_for(monkeypatch):
    import torch

    timed = []

    def rates(config, dtype, peak, device):
        timed.append(config.train.micro_batch_size)
        if config.train.micro_batch_size >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"dense_gemm": 0.1 * config.train.micro_batch_size, "attention": 0.2, "loss_head": 0.3}

    monkeypatch.setattr(calibrate_node, "compute_class_rates", rates)
    config = _config("--model.preset=mula-tiny-dense", "--train.micro_batch_size=1")
    own = {"dense_gemm": 0.05, "attention": 0.25, "loss_head": 0.35}
    table = calibrate_node.rates_by_rows(config, "fp32", 1e12, torch.device("cpu"), (1, 2, 4, 8), own)
    assert timed == [2, 4]  # its own micro-batch (1) is the efficiency block's; 8 never tried after 4 failed
    assert table == {"dense_gemm": {64: 0.05, 128: 0.2}, "attention": {64: 0.25, 128: 0.2},
                     "loss_head": {64: 0.35, 128: 0.3}}


def test_what_was_measured_is_printed_beside_the_clusters_figures(measured):
    lines = describe_node(load_cluster("h100"), measured)
    assert lines[0].startswith("  fp32 matmul 256^3:") and "of the 67 TFLOP/s h100 prices" in lines[0]
    assert any(line.split()[0] == "grouped_gemm" and "(h100: 0.600)" in line for line in lines)
    assert "memory_bound is the eager block's: compile_block off" in "\n".join(lines)
    assert any(line.split()[:3] == ["grouped_gemm", "by", "rows"] and "16: " in line and "64: " in line
               for line in lines)
    assert lines[-1].startswith("  intra-node, 2 devices: alpha")
    assert "(h100: 3 us, 450 GB/s); 64 KiB: all_reduce" in lines[-1]


def test_a_node_of_one_device_keeps_the_clusters_link():
    one = LocalAccelerators("cuda", "NVIDIA H100 80GB HBM3", 1, 79.19)
    h100 = load_cluster("h100")
    measured = {"efficiency": Efficiency().to_dict(), "link": None, "ranks": 1, "dtype": "bf16",
                "timed": {"matmul": {"flops_s": 7e14, "size": 8192}, "memory_bound_compiled": {"seconds": 1.0}}}
    text = calibrated_cluster_text(h100, measured, one, "a test")
    assert "intra_node_gb_s: 450  # h100's: one device here, nothing to time" in text
    assert describe_node(h100, measured)[-1] == "  intra-node: one device here, h100's link kept"


def test_numbers_never_take_exponent_form():
    """YAML 1.1 (PyYAML) reads 1e+04 as a string: every number is written positional."""
    assert calibrate_node._number(10000.0) == "10000" and calibrate_node._number(0.00063281) == "0.0006328"
    assert calibrate_node._number(3.14159) == "3.142"


@pytest.mark.slow  # torch.compile's C++ build of the block on a CPU: about a minute on 2 cores
def test_the_compiled_block_sets_memory_bound_and_the_eager_traffic():
    measured = measure_node(_config(), load_cluster("h100"), H100S, device_type="cpu", **SMALL)
    compiled = measured["timed"]["memory_bound_compiled"]
    assert "seconds" in compiled, compiled  # this CPU has a compiler: the block was compiled and timed
    eager = measured["timed"]["memory_bound"]
    assert measured["efficiency"]["memory_bound"] == pytest.approx(
        min(1.0, eager["bytes"] / compiled["seconds"] / 3350e9))
    assert measured["efficiency"]["eager_memory_traffic"] == pytest.approx(
        max(1.0, eager["seconds"] / compiled["seconds"]))


def test_the_cli_refuses_a_node_without_the_clusters_devices(monkeypatch, tmp_path, capsys):
    from optimus.train import hardware

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hardware, "probe_local_accelerators", lambda: None)
    code, _, err = _in_process(capsys, "plan", str(CONFIGS / "mula-tiny-moe.yaml"), "--cluster", "h100",
                               "--devices", "8", "--calibrate")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "torch sees no GPU or XPU here" in err and not (tmp_path / "h100-calibrated.yaml").exists()
    code, _, err = _in_process(capsys, "plan", str(CONFIGS / "mula-tiny-moe.yaml"), "--cluster", "h100",
                               "--devices", "8", "--calibrated-cluster", "x.yaml")
    assert code == 2 and "give --calibrate and a GPU cluster with it" in err


def test_the_cli_writes_the_calibrated_cluster_plans_on_it_and_keeps_it(monkeypatch, tmp_path, capsys):
    from optimus.train import hardware

    monkeypatch.chdir(tmp_path)
    cpu_node = LocalAccelerators("cpu", H100S.name, 2, 79.19)  # CPU ranks under an H100's name
    monkeypatch.setattr(hardware, "probe_local_accelerators", lambda: cpu_node)
    monkeypatch.setattr(calibrate_node, "measure_node",
                        functools.partial(calibrate_node.measure_node, compile_block=False, **SMALL))
    args = ("plan", str(CONFIGS / "mula-tiny-moe.yaml"), "--cluster", "h100", "--devices", "8", "--calibrate",
            "--train.seq_len=64", "--train.dtype=fp32")
    code, out, err = _in_process(capsys, *args)
    assert code == 0, err
    assert "calibrating h100 on this node's 2 NVIDIA H100 80GB HBM3" in out
    assert ("note: the compute classes timed at 1, 4, 8 x 64 tokens a micro-batch; each layout is priced at its "
            "own micro-batch's rows") in out
    assert "calibration written to h100-calibrated.yaml: plan on it with --cluster h100-calibrated.yaml" in out
    assert "valid layouts of 8 h100-calibrated devices (" in out.split("calibration written")[1]  # planned on it
    written = (tmp_path / "h100-calibrated.yaml").read_text()
    assert load_cluster("h100-calibrated.yaml").efficiency.dense_gemm < 0.05
    # again: the file stays unless --overwrite, refused before anything is measured
    code, out, err = _in_process(capsys, *args)
    assert code == 2 and "--calibrated-cluster h100-calibrated.yaml already exists" in err and "calibrating" not in out
    assert (tmp_path / "h100-calibrated.yaml").read_text() == written


def test_a_measurement_that_fails_on_the_node_is_one_line_and_writes_nothing(monkeypatch, tmp_path, capsys):
    from optimus.parallel.local_ranks import LocalRanksError
    from optimus.train import hardware

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hardware, "probe_local_accelerators", lambda: H100S)

    def out_of_memory(*args, **kwargs):
        raise LocalRanksError("rank 0 of 1 failed:\nTraceback (most recent call last):\n  ...\n"
                              "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.2 GiB")
    monkeypatch.setattr(calibrate_node, "measure_node", out_of_memory)
    code, _, err = _in_process(capsys, "plan", str(CONFIGS / "mula-tiny-moe.yaml"), "--cluster", "h100",
                               "--devices", "8", "--calibrate")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("calibrating h100 on this node failed (rank 0 of 1 failed: torch.OutOfMemoryError: CUDA out of memory. "
            "Tried to allocate 3.2 GiB); nothing was written") in err
    assert not list(tmp_path.iterdir())



@pytest.mark.parametrize("eager_s, traffic_bytes, memory_bound, eager_traffic", [
    (3.0, 2 * 3350e9, 1.0, 3.0),  # read at twice HBM's bandwidth (the count over-counts a fused kernel): 1 at most
    (0.5, 1675e9, 0.5, 1.0),  # eager faster than compiled (a compiler that fused badly): no traffic below 1
])
def test_the_compiled_blocks_time_sets_memory_bound_and_the_eager_traffic_within_their_bounds(
        monkeypatch, eager_s, traffic_bytes, memory_bound, eager_traffic):
    """memory_bound is the block's byte count over the compiled time, a fraction of the h100's 3,350 GB/s capped at
    1; eager_memory_traffic the eager time over the compiled, at least 1 (the node's forked ranks are a stand-in
    that returns what device 0 timed: 1 s compiled)."""
    timed = {"memory_bound": {"seconds": eager_s, "bytes": traffic_bytes},
             "memory_bound_compiled": {"seconds": 1.0}}

    def device_0(fn, world, *args, **kwargs):
        return [{"efficiency": {"memory_bound": 0.123, "eager_memory_traffic": 9.0}, "timed": timed}]

    monkeypatch.setattr(calibrate_node, "run_on_local_ranks", device_0)
    one = LocalAccelerators("cuda", "NVIDIA H100 80GB HBM3", 1, 79.19)
    measured = measure_node(_config(), load_cluster("h100"), one, device_type="cpu", **SMALL)
    assert measured["efficiency"] == {"memory_bound": pytest.approx(memory_bound),
                                      "eager_memory_traffic": pytest.approx(eager_traffic)}
    assert measured["link"] is None and measured["ranks"] == 1


def test_the_compiled_block_is_timed_on_a_micro_batchs_tokens_writing_its_outputs(monkeypatch):
    """The block runs on what one micro-batch feeds it (micro_batch_size x seq_len = 2 x 64 tokens) at the model's
    widths, its outputs written and their gradients read, as memory_bound_bytes counts them. (The compiler is a
    stand-in: only the shapes and the call are checked.)"""
    import torch

    config = _config()
    seen = {}

    def call(block, inputs, writes_outputs):
        seen.update(shapes=[tuple(t.shape) for t in inputs], writes_outputs=writes_outputs)
        return lambda: None

    monkeypatch.setattr(calibrate_node.torch, "compile", lambda fn, fullgraph: fn)
    monkeypatch.setattr(calibrate_node, "memory_bound_call", call)
    monkeypatch.setattr(calibrate_node, "device_seconds", lambda fn, repeats, device: 0.25)
    assert calibrate_node._compiled_block(config, torch.float32, torch.device("cpu")) == {"seconds": 0.25}
    # the mula-tiny-moe preset: d_model 256, SwiGLU's hidden width 1024
    assert seen == {"shapes": [(128, 256), (128, 1024), (128, 1024), (128, 256)], "writes_outputs": True}


def test_the_link_is_timed_over_at_most_a_clusters_node_of_devices(monkeypatch):
    """A machine of more devices than the cluster's node (4 here, a 2-device node asked for) times its collectives
    over one node's worth, the link the cluster file describes. (The forked ranks are stand-ins.)"""
    from dataclasses import replace

    worlds = []

    def ranks(fn, world, *args, **kwargs):
        worlds.append(world)
        if fn is calibrate_node._device_op_classes:
            return [{"efficiency": {}, "timed": {"memory_bound_compiled": {"not timed": "compile_block off"}}}]
        return [[{"op": "all_reduce", "bytes": 4096, "ranks": world, "seconds": 1e-5}]] * world

    monkeypatch.setattr(calibrate_node, "run_on_local_ranks", ranks)
    monkeypatch.setattr(calibrate_node, "fit_alpha_beta", lambda rows: {"alpha_us": 5.0, "beta_gb_s": 100.0})
    four = LocalAccelerators("cuda", "NVIDIA H100 80GB HBM3", 4, 79.19)
    measured = measure_node(_config(), replace(load_cluster("h100"), devices_per_node=2), four, device_type="cpu",
                            **SMALL)
    assert worlds == [1, 2] and measured["ranks"] == 2 and measured["link"]["alpha_us"] == 5.0


def test_the_largest_messages_times_name_a_mebibyte_in_mib():
    """1 MiB is named "1 MiB", not "1024 KiB"; below it in KiB; each collective's time at that size in ms."""
    rows = [{"op": "all_gather", "bytes": 2**20, "seconds": 0.0015},
            {"op": "all_reduce", "bytes": 2**20, "seconds": 0.002},
            {"op": "all_reduce", "bytes": 65536, "seconds": 0.0001}]
    assert calibrate_node._largest(rows, 2**20) == "1 MiB: all_reduce 2 ms, all_gather 1.5 ms"
    assert calibrate_node._largest(rows, 65536) == "64 KiB: all_reduce 0.1 ms"


def test_a_calibrated_file_that_cannot_be_written_leaves_nothing_beside_it(tmp_path, monkeypatch):
    """(the rename fails: neither the file nor a temporary one stands in the folder)"""
    import os

    def refuse(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        calibrate_node.write_calibrated(tmp_path / "h100-calibrated.yaml", "name: x\n")
    assert not list(tmp_path.iterdir())
