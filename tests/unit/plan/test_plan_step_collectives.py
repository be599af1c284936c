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
