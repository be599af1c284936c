"""The planner's terms for a host whose ranks share its cores (`here`): timed collectives answered from their
table, collectives that cannot hide behind compute, a pipeline bubble the idle ranks' cores absorb; and the layout
knobs the search now varies (zero2, ddp, the expert dispatch)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from optimus.config import load_config
from optimus.parallel.mesh import ParallelDims
from optimus.parallel.validate import validate_layout
from optimus.plan.cluster import Cluster
from optimus.plan.comms import all_reduce_time, all_to_all_time, group_link, ring_time
from optimus.plan.memory import ModelShape
from optimus.plan.step_time import StepTime, busiest_expert_pace, step_time

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MIB = 1024 * 1024


def _host(**changes) -> Cluster:
    base = Cluster(name="host", device="H100", devices_per_node=2, memory_gb=8, hbm_gb_s=10,
                   intra_node_gb_s=1, intra_node_latency_us=200, inter_node_gb_s=2, inter_node_latency_us=200,
                   node_power_kw=0.1, pue=1.0, grid_kgco2_per_kwh=0.0)
    return replace(base, **changes)


TABLE = {  # seconds for 2 ranks at 1 MiB and 64 MiB: reduce-scatter twice all-gather's, as gloo's was
    "all_gather": {(2, 2, False): [[MIB, 0.001], [64 * MIB, 0.100]]},
    "reduce_scatter": {(2, 2, False): [[MIB, 0.002], [64 * MIB, 0.200]]},
    "all_reduce": {(2, 2, False): [[MIB, 0.0015], [64 * MIB, 0.120]]},
    "all_to_all": {(2, 2, False): [[MIB, 0.0008], [64 * MIB, 0.090]]},
}


def test_a_timed_table_answers_on_node_collectives_exactly_and_in_log_log_between():
    link = group_link(ParallelDims(dp_shard=2, world_size=2), ("dp_shard_mod_ep", "ep"), _host(measured_collectives=TABLE))
    assert ring_time(link, 64 * MIB) == pytest.approx(0.100)
    assert ring_time(link, 64 * MIB, "reduce_scatter") == pytest.approx(0.200)
    assert all_reduce_time(link, MIB) == pytest.approx(0.0015)
    assert all_to_all_time(link, 64 * MIB) == pytest.approx(0.090)
    middle = ring_time(link, 8 * MIB)  # log-log: 8 MiB is half way (in logs) from 1 to 64 MiB
    assert middle == pytest.approx(math.exp((math.log(0.001) + math.log(0.100)) / 2))
    assert ring_time(link, 128 * MIB) == pytest.approx(0.200)  # past the largest: proportional to bytes
    assert ring_time(link, 1024) == pytest.approx(0.001)  # below the smallest: its time
    # the alpha-beta model where there is no table
    plain = group_link(ParallelDims(dp_shard=2, world_size=2), ("dp_shard_mod_ep", "ep"), _host())
    assert ring_time(plain, 64 * MIB) == pytest.approx(200e-6 + 0.5 * 64 * MIB / 1e9)


def _step(overrides: list[str], ranks: int, cluster: Cluster):
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=fp32", "--train.seq_len=128",
                                                              "--train.global_batch_size=8", *overrides])
    layout = validate_layout(config, ranks)
    return step_time(layout.config, layout.dims, ModelShape.of(layout.config), cluster, None,
                     layout.batch.micro_batches)


def test_fsdp_collectives_hide_behind_compute_only_where_links_move_the_bytes():
    fsdp = ["--parallel.dp_shard=2"]
    slow_compute = dict(measured_peak_flops={"fp32": 1e9, "bf16": 1e9})  # compute far longer than the collectives
    overlapped = _step(fsdp, 2, _host(**slow_compute))
    on_the_cores = _step(fsdp, 2, _host(**slow_compute, comm_overlaps_compute=False))
    assert overlapped.parts["fsdp_exposed"] == 0 and on_the_cores.parts["fsdp_exposed"] > 0.01
    assert on_the_cores.step_s - overlapped.step_s == pytest.approx(on_the_cores.parts["fsdp_exposed"])
    # the copies into and out of FSDP's buffers are the rank's own work: never hidden
    assert overlapped.parts["buffer_copies"] == on_the_cores.parts["buffer_copies"] > 0


def _busy(time) -> float:
    """The last stage's own work: the step less what the pipeline, the step's syncs and the update add."""
    return time.step_s - time.parts["bubble"] - time.parts["dp_sync"] - time.parts["optimizer"]


def test_the_pipeline_fills_and_drains_through_the_stages_without_the_head():
    """1F1B, 2 stages, 4 micro-batches, compute only (instant links and copies). Equal stages (a small vocabulary):
    the textbook bubble, one micro-batch of 4. The tiny model's 50k-vocabulary head makes the last stage the slow
    one: it runs its 4 micro-batches back to back, and filling and draining go through the light first stage."""
    fast = _host(hbm_gb_s=1e6, intra_node_gb_s=1e6, intra_node_latency_us=0)
    pp = ["--parallel.pp=2", "--train.micro_batch_size=2"]
    equal = _step([*pp, "--model.vocab_size=256"], 2, fast)
    assert equal.parts["bubble"] == pytest.approx(_busy(equal) / 4, rel=0.15)
    head_heavy = _step(pp, 2, fast)
    assert 0 < head_heavy.parts["bubble"] < 0.5 * _busy(head_heavy) / 4


def test_interleaving_two_virtual_stages_halves_the_fill_and_drain():
    """Interleaved 1F1B: each rank holds v = 2 chunks of half the blocks, so the pipe fills and drains in
    (pp - 1) / v chunk times: half 1F1B's bubble (equal stages, compute only, as above)."""
    fast = _host(hbm_gb_s=1e6, intra_node_gb_s=1e6, intra_node_latency_us=0)
    pp = ["--parallel.pp=2", "--train.micro_batch_size=2", "--model.vocab_size=256"]
    plain = _step([*pp, "--parallel.pp_schedule=1f1b"], 2, fast)
    interleaved = _step([*pp, "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2"], 2, fast)
    assert _busy(interleaved) == pytest.approx(_busy(plain), rel=0.02)
    assert interleaved.parts["bubble"] == pytest.approx(plain.parts["bubble"] / 2, rel=0.05)


def test_the_stage_without_the_head_pays_its_blocks_operator_costs_in_full():
    """Filling and draining the pipe go through the first stage, which dispatches its blocks' DTensor operators
    whatever share of the FLOPs the head takes: 1F1B over 2 stages, 4 micro-batches, tp 2, the 50k head."""
    from optimus.plan.dtensor_cost import dtensor_operators

    tp_pp = ["--parallel.tp=2", "--parallel.pp=2", "--train.micro_batch_size=2"]
    host = _host(devices_per_node=4, hbm_gb_s=1e6, intra_node_gb_s=1e6, intra_node_latency_us=0)
    free, costly = (_step(tp_pp, 4, replace(host, efficiency=replace(host.efficiency, dtensor_overhead_us=us)))
                    for us in (0.0, 1000.0))
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.seq_len=128", *tp_pp])
    first_stage = 1000e-6 * dtensor_operators(config, 2, False, root=False)  # 2 of the 4 blocks, no root
    # the bubble is one micro-batch of the first stage (pp - 1 = 1, v = 1): it grows by that stage's dispatch
    assert costly.parts["bubble"] - free.parts["bubble"] == pytest.approx(first_stage, rel=1e-6)


def test_ranks_that_outnumber_the_cores_absorb_the_pipeline_bubble():
    pp = ["--parallel.pp=2", "--train.micro_batch_size=2", "--model.vocab_size=256"]  # equal stages, a bubble of 1/5
    whole_cores = _step(pp, 2, _host())
    shared = _step(pp, 2, _host(core_share=0.5))
    assert whole_cores.parts["bubble"] > 0.2 * _busy(whole_cores)
    # at half a core per rank the critical path (busy x 0.5 x 5/4) is shorter than the stages' average busy time:
    # no idle micro-batch slots left, only the sends that fill the pipe (under a tenth of the whole-core bubble)
    assert shared.parts["bubble"] < 0.1 * whole_cores.parts["bubble"]


def test_ranks_that_outnumber_the_cores_absorb_the_busiest_expert_ranks_extra_rows():
    """The busiest expert-holding rank paces the step on cores of its own; where ranks share cores, the ranks that
    wait give it their cores' time: at half a core per rank it runs alone at twice its priced speed, so up to 2x
    its balanced rows cost nothing more, and only the excess beyond shows."""
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.dtype=fp32", "--train.seq_len=128",
                                                            "--train.global_batch_size=8", "--parallel.dp_shard=2",
                                                            "--parallel.ep=2"])
    layout = validate_layout(config, 2)

    def step(cluster: Cluster, imbalance: float) -> float:
        return step_time(layout.config, layout.dims, ModelShape.of(layout.config), cluster, None,
                         layout.batch.micro_batches, imbalance).step_s

    slow_compute = dict(measured_peak_flops={"fp32": 1e9, "bf16": 1e9})  # GEMMs above the weights' roofline
    whole, shared = _host(**slow_compute), _host(**slow_compute, core_share=0.5)
    assert step(whole, 1.5) > step(whole, 1.0)
    assert step(shared, 1.5) == step(shared, 2.0) == step(shared, 1.0)
    assert step(shared, 3.0) == pytest.approx(step(whole, 1.5) - step(whole, 1.0) + step(shared, 1.0))


def test_the_busiest_expert_rank_alone_in_its_group_cannot_take_every_freed_core():
    """Processor sharing on 4 ranks and 2 cores: with ep 2 the two busiest ranks (one a pair) get a core each once
    their peers wait, and catch up exactly; with ep 4 the one busiest rank can use one core of the two, so its extra
    rows cost (imbalance - lighter) x (0.5 / 1) more than the balanced phase."""
    assert busiest_expert_pace(1.5, 2, 0.5) == busiest_expert_pace(2.0, 2, 0.5) == 1.0
    lighter = (4 - 1.2) / 3
    assert busiest_expert_pace(1.2, 4, 0.5) == pytest.approx(lighter + (1.2 - lighter) * 0.5)  # 1.067
    assert busiest_expert_pace(1.2, 4, 1.0) == pytest.approx(1.2)  # cores of their own: the rows, as they are
    assert busiest_expert_pace(1.0, 4, 0.5) == busiest_expert_pace(1.3, 1, 0.5) == 1.0

    def step(ep: int, imbalance: float) -> StepTime:
        config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.dtype=fp32", "--train.seq_len=128",
                                                                "--train.global_batch_size=8", "--parallel.dp_shard=4",
                                                                f"--parallel.ep={ep}"])
        layout = validate_layout(config, 4)
        host = _host(measured_peak_flops={"fp32": 1e9, "bf16": 1e9}, core_share=0.5)
        return step_time(layout.config, layout.dims, ModelShape.of(layout.config), host, None,
                         layout.batch.micro_batches, imbalance)

    assert step(2, 1.2).step_s == step(2, 1.0).step_s
    balanced, skewed = step(4, 1.0), step(4, 1.2)
    extra = skewed.parts["compute"] - balanced.parts["compute"]
    assert extra > 0 and skewed.step_s - balanced.step_s == pytest.approx(extra, rel=1e-6)


def test_zero2_reduces_every_micro_batch_and_ddp_all_reduces_once_unless_told_otherwise():
    host = _host(comm_overlaps_compute=False)
    two = ["--parallel.dp_shard=2", "--train.micro_batch_size=2"]  # 2 micro-batches per rank
    zero1 = _step([*two, "--parallel.shard_mode=zero1"], 2, host)
    zero2 = _step([*two, "--parallel.shard_mode=zero2"], 2, host)
    ddp = _step([*two, "--parallel.shard_mode=ddp"], 2, host)
    # zero1: one fp32 reduce-scatter + one all-gather per step; zero2: the reduce-scatter in each micro-batch
    assert zero2.parts["zero2_exposed"] > 0 and zero2.parts["dp_sync"] < zero1.parts["dp_sync"]
    assert zero2.parts["zero2_exposed"] + zero2.parts["dp_sync"] > zero1.parts["dp_sync"]
    assert ddp.parts["dp_sync"] > 0 and ddp.parts["zero2_exposed"] == 0
    # unless told to sync every micro-batch (no no_sync): then each backward all-reduces
    each = _step([*two, "--parallel.shard_mode=ddp", "--parallel.defer_grad_sync=none"], 2, host)
    assert each.parts["dp_sync"] == pytest.approx(2 * ddp.parts["dp_sync"])


def test_deferring_all_gradient_sync_reduce_scatters_once_a_step():
    host = _host(comm_overlaps_compute=False, measured_collectives=TABLE)
    fsdp = ["--parallel.dp_shard=2"]
    one = _step([*fsdp, "--train.micro_batch_size=4"], 2, host)  # 1 micro-batch: all-gathers + reduce-scatter
    every = _step([*fsdp, "--train.micro_batch_size=2"], 2, host)  # 2, each reduce-scattered (the default)
    deferred = _step([*fsdp, "--train.micro_batch_size=2", "--parallel.defer_grad_sync=all"], 2, host)
    reduce_scatter = every.parts["fsdp_exposed"] - deferred.parts["fsdp_exposed"]
    assert reduce_scatter > 0.01  # the second micro-batch only gathers the weights again
    assert deferred.parts["fsdp_exposed"] == pytest.approx(2 * one.parts["fsdp_exposed"] - reduce_scatter)
    assert deferred.parts["buffer_copies"] < every.parts["buffer_copies"]
    assert deferred.step_s - one.step_s < every.step_s - one.step_s


def test_hsdp_all_reduces_each_units_shard_in_the_backward():
    hsdp = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.micro_batch_size=1"]  # 2 micro-batches
    host = _host(comm_overlaps_compute=False)
    once = _step(hsdp, 4, host)  # the default: the all-reduce in the last micro-batch's backward only
    each = _step([*hsdp, "--parallel.defer_grad_sync=none"], 4, host)
    deferred = _step([*hsdp, "--parallel.defer_grad_sync=all"], 4, host)
    all_reduce = each.parts["fsdp_exposed"] - once.parts["fsdp_exposed"]
    reduce_scatter = once.parts["fsdp_exposed"] - deferred.parts["fsdp_exposed"]
    assert all_reduce > 0.001 and reduce_scatter > 0.001
    assert once.parts["dp_sync"] == each.parts["dp_sync"] == deferred.parts["dp_sync"] == 0
    # one all-reduce per FSDP unit (every block and the root), each paying the link's latency (dp_replicate spans
    # the two 2-rank nodes; dp_shard stays on one)
    far = replace(host, inter_node_latency_us=1200)
    far_all_reduce = (_step([*hsdp, "--parallel.defer_grad_sync=none"], 4, far).parts["fsdp_exposed"] -
                      _step(hsdp, 4, far).parts["fsdp_exposed"])
    dims = ParallelDims(dp_replicate=2, dp_shard=2, world_size=4)
    one_call = (all_reduce_time(group_link(dims, ("dp_replicate",), far), 1024) -
                all_reduce_time(group_link(dims, ("dp_replicate",), host), 1024))
    units = load_config(CONFIGS / "mula-tiny-dense.yaml").model.n_layers + 1
    assert one_call > 0 and far_all_reduce - all_reduce == pytest.approx(units * one_call)
    # where links move bytes beside compute, the backward hides it as it hides the reduce-scatters
    hidden = _step(hsdp, 4, _host(measured_peak_flops={"fp32": 1e9, "bf16": 1e9}))
    assert hidden.parts["fsdp_exposed"] == 0 and hidden.parts["dp_sync"] == 0


def test_the_search_varies_shard_mode_and_expert_dispatch():
    from optimus.plan.search import plan

    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.dtype=fp32", "--train.seq_len=128",
                                                            "--train.global_batch_size=8"])
    layouts = [c.layout() for c in plan(config, _host(devices_per_node=4, memory_gb=64), 4)]
    assert {"fsdp", "zero1", "zero2", "ddp"} <= {lay["shard_mode"] for lay in layouts}
    with_ep = [lay for lay in layouts if lay["ep"] > 1]
    assert {"all_to_all", "allgather"} == {lay["ep_dispatch"] for lay in with_ep}
    assert all(lay["ep_dispatch"] == "none" for lay in layouts if lay["ep"] == 1)
    assert all(lay["tp"] == lay["pp"] == lay["ep"] == 1 for lay in layouts if lay["shard_mode"] == "ddp")
