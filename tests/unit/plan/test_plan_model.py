"""The planner's pieces: presets load, memory agrees with the dry run, bubble and alpha-beta arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.config import ConfigError, load_config
from optimus.parallel.mesh import ParallelDims
from optimus.plan.cluster import Cluster, cluster_names, load_cluster
from optimus.plan.comms import all_reduce_time, all_to_all_time, group_link, ring_time
from optimus.plan.step_time import bubble_fraction
from tests.helpers.distributed import run_forked
from optimus.train.hardware import DEVICE_PEAKS_TFLOPS

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_every_preset_loads_and_takes_its_peak_from_the_hardware_table():
    assert {"aurora", "frontier", "lumi", "h100", "h200", "a100"} <= set(cluster_names())
    peaks = {fragment: (bf16, fp32) for fragment, bf16, fp32, _ in DEVICE_PEAKS_TFLOPS}
    for name in cluster_names():
        cluster = load_cluster(name)
        assert cluster.peak_flops("bf16") == peaks[cluster.device][0] * 1e12
        assert cluster.peak_flops("fp32") == peaks[cluster.device][1] * 1e12
        assert cluster.devices_per_node > 0 and cluster.memory_gb > 0 and 1.0 <= cluster.pue < 2.0
    assert (load_cluster("aurora").devices_per_node, load_cluster("aurora").memory_gb) == (12, 64)
    assert (load_cluster("lumi").devices_per_node, load_cluster("lumi").inter_node_gb_s) == (8, 100)


def test_unknown_cluster_is_one_clear_error():
    with pytest.raises(ConfigError, match="unknown cluster 'summit': choose one of"):
        load_cluster("summit")


def _memory_pair(path: str, world: int, overrides: list[str]) -> tuple[float, float]:
    from optimus.parallel.dry_run import dry_run
    from optimus.parallel.validate import validate_layout
    from optimus.plan.memory import ModelShape, peak_memory

    config = load_config(path, overrides)
    measured = max(rank.total for rank in dry_run(config, world).ranks)
    layout = validate_layout(config, world)
    return measured, peak_memory(layout.config, layout.dims, ModelShape.of(layout.config))


@pytest.mark.parametrize("config,overrides", [
    ("mula-tiny-moe.yaml", ["--parallel.dp_shard=8", "--parallel.ep=4"]),  # FSDP + EP
    ("mula-tiny-moe.yaml", ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.pp=2",
                            "--parallel.pp_schedule=gpipe", "--train.micro_batch_size=1"]),  # HSDP + EP + GPipe
    ("mula-tiny-moe.yaml", ["--parallel.dp_shard=4", "--parallel.tp=2", "--train.activation_checkpointing=full"]),
    ("mula-tiny-dense.yaml", ["--parallel.dp_shard=2", "--parallel.pp=4", "--parallel.shard_mode=zero1",
                              "--train.activation_checkpointing=selective"]),
])
def test_memory_model_agrees_with_the_dry_run(config, overrides):
    measured, predicted = run_forked(_memory_pair, str(CONFIGS / config), 8,
                                     ["--train.global_batch_size=16", *overrides], timeout=240)
    # the issue asks for 10%; the model counts the dry run's own terms, so it agrees far closer (0.1% seen)
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_bubble_is_the_textbook_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)  # (pp - 1) / (m + pp - 1)
    assert bubble_fraction(8, 8) == pytest.approx(7 / 15)
    assert bubble_fraction(4, 8, virtual_stages=2) == pytest.approx(1.5 / 9.5)  # interleaved divides by v


def _toy(n: int = 4) -> Cluster:
    return Cluster(name="toy", device="H100", devices_per_node=n, memory_gb=80, hbm_gb_s=3000,
                   intra_node_gb_s=100, intra_node_latency_us=5, inter_node_gb_s=40, inter_node_latency_us=10,
                   node_power_kw=1, pue=1.0, grid_kgco2_per_kwh=0.0)


def test_alpha_beta_on_a_hand_computed_case():
    cluster = _toy(n=4)
    # tp = 4 is innermost: one node, the intra-node link. all-gather of 4 GB: 3 x 5 us + 3/4 x 4e9 / 100e9
    tp = group_link(ParallelDims(tp=4, dp_shard=2, world_size=8), ("tp",), cluster)
    assert (tp.size, tp.per_node) == (4, 4)
    assert ring_time(tp, 4e9) == pytest.approx(3 * 5e-6 + 0.75 * 4e9 / 100e9)
    assert all_reduce_time(tp, 4e9) == pytest.approx(2 * ring_time(tp, 4e9))
    # dp_shard = 2 outside tp = 4: its two members are on different nodes, one per node, and each node's four
    # rings share its 40 GB/s: 10 GB/s each. 1 x 10 us + 1/2 x 1e9 / 10e9
    dp = group_link(ParallelDims(tp=4, dp_shard=2, world_size=8), ("dp_shard_mod_ep", "ep"), cluster)
    assert (dp.size, dp.per_node) == (2, 1)
    assert ring_time(dp, 1e9) == pytest.approx(10e-6 + 0.5 * 1e9 / 10e9)
    # ep = 8 over two nodes of 4: half of what a rank sends stays on its node (3/8 to 3 peers), half leaves it
    ep = group_link(ParallelDims(dp_shard=8, ep=8, world_size=8), ("ep",), cluster)
    assert (ep.size, ep.per_node) == (8, 4)
    send = 8e8
    expected = 7 * 10e-6 + max(send * 3 / 8 / 100e9, send * 4 / 8 / (40e9 / 4))
    assert all_to_all_time(ep, send, cluster) == pytest.approx(expected)


def test_one_device_step_is_compute_plus_optimizer_and_mfu_follows():
    from optimus.models.flops import count_parameters, flops_per_token
    from optimus.models.transformer import build_model
    from optimus.parallel.validate import validate_layout
    from optimus.plan.memory import ModelShape
    from optimus.plan.step_time import Efficiency, step_time

    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=bf16", "--train.micro_batch_size=8",
                                                              "--train.seq_len=4096"])
    layout = validate_layout(config, 1)
    cluster = _toy()
    time = step_time(layout.config, layout.dims, ModelShape.of(layout.config), cluster, Efficiency(0.5, 0.5, 0.5), 1)
    assert time.parts["tp"] == time.parts["ep"] == time.parts["pp_p2p"] == time.parts["dp_sync"] == time.bubble_fraction == 0
    tokens = 8 * 4096
    model = build_model(layout.config.model, device="meta")
    flops = flops_per_token(count_parameters(model, layout.config.model), layout.config.model, 4096)
    # compute bound at 32k tokens per micro-batch: exactly the FLOPs at half the datasheet peak
    assert time.parts["compute"] == pytest.approx(tokens * flops / (0.5 * cluster.peak_flops("bf16")), rel=1e-3)
    assert time.step_s == pytest.approx(time.parts["compute"] + time.parts["optimizer"])
    assert time.mfu == pytest.approx(0.5 * time.parts["compute"] / time.step_s, rel=1e-3)


def test_energy_is_nodes_times_power_times_time_times_pue():
    from optimus.plan.search import run_cost

    aurora = load_cluster("aurora")
    cost = run_cost(aurora, devices=24, tokens_per_s=1e6, tokens=3.6e9)  # one hour on 2 nodes
    assert cost["days"] == pytest.approx(1 / 24)
    assert cost["energy_mwh"] == pytest.approx(2 * aurora.node_power_kw * 1.0 * aurora.pue / 1000)
    assert cost["co2_t"] == pytest.approx(cost["energy_mwh"] * aurora.grid_kgco2_per_kwh)
