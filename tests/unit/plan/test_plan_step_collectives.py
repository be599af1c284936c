"""The step's small collectives priced: a tree's latency across nodes, nothing for one rank, a part of the step.
(Their count against a real step: tests/distributed/test_step_collectives.py.)"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from optimus.config import load_config
from optimus.parallel.validate import validate_layout
from optimus.plan.cluster import load_cluster
from optimus.plan.comms import all_reduce_time, group_link, sync_after_compute
from optimus.plan.memory import ModelShape
from optimus.plan.step_collectives import step_collectives, step_collectives_time
from optimus.plan.step_time import COLLECTIVE_PARTS, step_time

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _layout(name: str, world: int, *overrides: str):
    return validate_layout(load_config(str(CONFIGS / name), list(overrides)), world)


def test_a_few_bytes_across_thousands_of_ranks_pay_a_trees_latency_not_a_rings():
    aurora = load_cluster("aurora")
    layout = _layout("mula-220b-a10b.yaml", 3072, "--parallel.ep=12", "--parallel.pp=8", "--parallel.dp_shard=384",
                     "--train.global_batch_size=3072")
    dims = layout.dims
    whole_job = group_link(dims, ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp"), aurora)
    assert whole_job.spans_nodes and whole_job.size == 3072
    ring = all_reduce_time(whole_job, 4)
    tree = 2 * (math.ceil(math.log2(whole_job.per_node)) * whole_job.intra_alpha +
                math.ceil(math.log2(whole_job.nodes)) * whole_job.inter_alpha)
    seconds = step_collectives_time(layout.config, dims, aurora, layout.config.model.n_layers // dims.pp)
    calls = step_collectives(layout.config, dims, layout.config.model.n_layers // dims.pp)
    assert ring > 10 * tree  # 2 x 255 node hops each way against 2 x 8
    assert 0 < seconds < len(calls) * 2 * tree  # none priced as the ring


def test_one_rank_has_none_and_a_job_pays_them_as_part_of_its_step():
    h100 = load_cluster("h100")
    alone = _layout("mula-tiny-moe.yaml", 1)
    assert step_collectives_time(alone.config, alone.dims, h100, alone.config.model.n_layers) == 0
    layout = _layout("mula-tiny-moe.yaml", 8, "--parallel.dp_shard=4", "--parallel.tp=2", "--parallel.ep=2")
    predicted = step_time(layout.config, layout.dims, ModelShape.of(layout.config), h100,
                          micro_batches=layout.batch.micro_batches)
    assert "step_collectives" in COLLECTIVE_PARTS
    assert predicted.parts["step_collectives"] == pytest.approx(
        step_collectives_time(layout.config, layout.dims, h100, layout.config.model.n_layers))
    assert predicted.parts["step_collectives"] > 0


def test_where_the_sync_was_timed_only_the_first_call_after_the_update_pays_it_once_a_step():
    # a host's timed cost of a collective reached after compute (here.py): 2 ms after 10 ms, 1.5 ms after 40
    timed = replace(load_cluster("h100"), collective_sync=((0.01, 0.002), (0.04, 0.0015)))
    each_step = _layout("mula-tiny-dense.yaml", 8, "--parallel.dp_shard=8")
    logged_every_10 = _layout("mula-tiny-dense.yaml", 8, "--parallel.dp_shard=8", "--train.log_every=10",
                              "--resilience.checkpoint_on_signal=false")
    for layout, steps_with_one in ((each_step, 1.0), (logged_every_10, 0.1)):
        layers = layout.config.model.n_layers
        back_to_back = step_collectives_time(layout.config, layout.dims, timed, layers)
        after_update = step_collectives_time(layout.config, layout.dims, timed, layers, update_s=0.02)
        expected = sync_after_compute(timed.collective_sync, 0.02) * steps_with_one
        assert after_update - back_to_back == pytest.approx(expected)


def test_the_norms_partial_gradients_are_summed_once_a_step_only_where_fsdp_does_not_each_micro_batch():
    """Under tp the sequence-parallel norms' gradients are Partial sums: FSDP redistributes each in every
    micro-batch's backward (block_collectives.norm_gradient_reduces), so the step sums nothing more; the other
    shard modes keep them Partial and sum all of them (2 norms a block and the final one, d_model fp32 each) in one
    all-reduce a step."""
    def partial_sums(mode: str) -> tuple[list, int]:
        layout = _layout("mula-tiny-dense.yaml", 4, "--parallel.dp_shard=2", "--parallel.tp=2",
                         f"--parallel.shard_mode={mode}")
        model = layout.config.model
        calls = [c for c in step_collectives(layout.config, layout.dims, model.n_layers) if c.what == "partial sums"]
        return [(c.group, c.nbytes) for c in calls], 4 * (2 * model.n_layers + 1) * model.d_model

    fsdp, _ = partial_sums("fsdp")
    zero1, nbytes = partial_sums("zero1")
    assert fsdp == [] and zero1 == [(("tp",), nbytes)]


def test_zeros_gradient_norm_spans_the_job_and_one_rank_has_none():
    from optimus.plan.step_collectives import MESH_DIMS, gradient_norm_groups

    for mode in ("zero1", "zero2"):
        alone = _layout("mula-tiny-moe.yaml", 1, f"--parallel.shard_mode={mode}")
        assert gradient_norm_groups(alone.config, alone.dims) == []
        spread = _layout("mula-tiny-moe.yaml", 2, "--parallel.dp_shard=2", f"--parallel.shard_mode={mode}")
        assert gradient_norm_groups(spread.config, spread.dims) == [MESH_DIMS]


def test_the_pipeline_sums_three_loss_terms_and_every_layers_expert_counts_in_fp64():
    """Over pp, _gather_terms sends the loss terms but the total (ce, aux, z: 3) and each of the 4 layers' 16 expert
    counts, 8 bytes each."""
    layout = _layout("mula-tiny-moe.yaml", 2, "--parallel.pp=2")
    (call,) = [c for c in step_collectives(layout.config, layout.dims, 2) if c.what == "pipeline terms"]
    assert (call.op, call.group, call.nbytes) == ("all_reduce", ("pp",), 8 * (3 + 4 * 16))


def test_expert_load_is_summed_only_where_several_exchange_groups_hold_the_experts():
    """ep 2 = dp_shard 2: one exchange group, whose own counts are the load; no expert-load collective. HSDP 2 x 2
    at ep 2: two groups, their counts summed over ep and the busiest group's share maxed over them."""
    one = _layout("mula-tiny-moe.yaml", 2, "--parallel.dp_shard=2", "--parallel.ep=2")
    assert not [c for c in step_collectives(one.config, one.dims, 4) if c.what == "expert load"]
    two = _layout("mula-tiny-moe.yaml", 4, "--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2")
    assert [c.group for c in step_collectives(two.config, two.dims, 4) if c.what == "expert load"] == [
        ("ep",), ("dp_replicate", "dp_shard_mod_ep")]


def test_a_tree_all_reduce_climbs_the_node_then_the_nodes():
    from optimus.plan.step_collectives import _tree_all_reduce

    aurora = load_cluster("aurora")
    layout = _layout("mula-220b-a10b.yaml", 3072, "--parallel.ep=12", "--parallel.pp=8", "--parallel.dp_shard=384",
                     "--train.global_batch_size=3072")
    link = group_link(layout.dims, ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp"), aurora)
    hops_on, hops_across = math.ceil(math.log2(link.per_node)), math.ceil(math.log2(link.nodes))
    assert hops_on >= 1 and hops_across >= 1
    assert _tree_all_reduce(link, 4) == pytest.approx(2 * (hops_on * (link.intra_alpha + 4 / link.intra_beta) +
                                                          hops_across * (link.inter_alpha + 4 / link.inter_beta)))


def test_a_pipelines_gradient_norm_is_summed_over_its_stages_last():
    from optimus.plan.step_collectives import gradient_norm_groups

    piped = _layout("mula-tiny-moe.yaml", 4, "--parallel.dp_shard=2", "--parallel.pp=2")
    assert gradient_norm_groups(piped.config, piped.dims) == [("dp_shard_mod_ep",), ("pp",)]


def test_a_pair_on_one_node_sums_its_loss_terms_on_the_ring_where_that_beats_the_tree():
    """Two ranks on a node: the ring moves the bytes once each way, a tree's one hop twice, so past a few bytes the
    ring is cheaper, and each call is priced at the cheaper of the two (not at the tree alone)."""
    from optimus.plan import step_collectives as module

    h100 = load_cluster("h100")
    layout = _layout("mula-220b-a10b.yaml", 2, "--parallel.dp_shard=2", "--parallel.ep=1", "--parallel.pp=1",
                     "--train.global_batch_size=2")
    config, dims = layout.config, layout.dims
    layers = config.model.n_layers
    loss_terms = [c for c in step_collectives(config, dims, layers) if c.what == "loss terms"]
    assert loss_terms and loss_terms[0].nbytes > 60_000  # 64 layers x 240 experts' counts
    link = group_link(dims, loss_terms[0].group, h100)
    assert all_reduce_time(link, loss_terms[0].nbytes) < module._tree_all_reduce(link, loss_terms[0].nbytes)
    priced = step_collectives_time(config, dims, h100, layers)
    tree_only = sum((module.ring_time(group_link(dims, c.group, h100), c.nbytes, "all_gather") if c.op == "all_gather"
                     else module._tree_all_reduce(group_link(dims, c.group, h100), c.nbytes)) * c.per_step
                    for c in step_collectives(config, dims, layers) if group_link(dims, c.group, h100).size > 1)
    assert priced < tree_only
