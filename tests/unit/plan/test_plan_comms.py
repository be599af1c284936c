"""The alpha-beta collective model (plan/comms.py) priced by hand: each term (latency per hop, bytes over the link,
the hierarchical and the flat ring, all-to-all's on- and off-node shares, a pipeline send) checked on its own."""

from __future__ import annotations

import pytest

from optimus.parallel.mesh import ParallelDims
from optimus.plan.cluster import Cluster
from optimus.plan.comms import Link, all_reduce_time, all_to_all_time, group_link, ring_time, send_time

US, GB = 1e-6, 1e9
ONE_NODE = Link(size=8, per_node=8, intra_alpha=5 * US, intra_beta=100 * GB, inter_alpha=10 * US, inter_beta=25 * GB)
FOUR_NODES = Link(size=32, per_node=8, intra_alpha=5 * US, intra_beta=100 * GB, inter_alpha=10 * US,
                  inter_beta=25 * GB)


def test_a_ring_on_one_node_pays_a_latency_per_hop_and_its_share_of_the_bytes():
    assert ring_time(ONE_NODE, 1.0) == pytest.approx(7 * 5 * US + 7 / 8 / (100 * GB))  # the latency alone
    assert ring_time(ONE_NODE, 8e9) == pytest.approx(7 * 5 * US + 7 / 8 * 8e9 / (100 * GB))
    assert ring_time(ONE_NODE, 0) == 0 and ring_time(Link(1, 1, 1.0, 1.0, 1.0, 1.0), 1e9) == 0


def test_across_nodes_the_cheaper_of_the_hierarchical_ring_and_the_flat_one():
    nbytes = 4e9
    intra = 7 * 5 * US + 7 / 8 * nbytes / (100 * GB)
    hierarchical = intra + 3 * 10 * US + 3 / 4 * (nbytes / 8) / (25 * GB)  # a node's members share the network
    flat = 31 * 10 * US + 31 / 32 * nbytes / min(100 * GB, 8 * 25 * GB)
    assert ring_time(FOUR_NODES, nbytes) == pytest.approx(min(hierarchical, flat))
    # tiny messages: the flat ring's 31 network hops cost more than 7 node hops + 3 network hops
    assert ring_time(FOUR_NODES, 1.0) == pytest.approx(7 * 5 * US + 3 * 10 * US, rel=1e-6)


def test_an_all_reduce_is_a_reduce_scatter_and_an_all_gather():
    assert all_reduce_time(FOUR_NODES, 4e9) == pytest.approx(2 * ring_time(FOUR_NODES, 4e9))
    assert all_reduce_time(FOUR_NODES, 0) == 0


def test_all_to_all_sends_its_on_and_off_node_shares_at_once():
    send = 32e6  # each rank's whole send, 1/32 to every member (itself included)
    on_node, off_node = send * 7 / 32, send * 24 / 32
    latency = 7 * 5 * US + 24 * 10 * US
    assert all_to_all_time(FOUR_NODES, send) == pytest.approx(latency + max(on_node / (100 * GB), off_node / (25 * GB)))
    assert all_to_all_time(ONE_NODE, 8e6) == pytest.approx(7 * 5 * US + 8e6 * 7 / 8 / (100 * GB))


def test_a_pipeline_send_goes_over_the_network_only_when_the_stages_span_nodes():
    assert send_time(ONE_NODE, 1e6) == pytest.approx(5 * US + 1e6 / (100 * GB))
    assert send_time(FOUR_NODES, 1e6) == pytest.approx(10 * US + 1e6 / (25 * GB))


def _measured(table: dict, devices_per_node: int = 4) -> Cluster:
    """A host of `devices_per_node` ranks that timed the collectives of `table` (here.collective_table's form)."""
    return Cluster(name="host", device="H100", devices_per_node=devices_per_node, memory_gb=8, hbm_gb_s=10,
                   intra_node_gb_s=1, intra_node_latency_us=200, inter_node_gb_s=2, inter_node_latency_us=200,
                   node_power_kw=0.1, pue=1.0, grid_kgco2_per_kwh=0.0, measured_collectives=table)


def test_a_group_size_not_timed_reads_the_nearest_one_scaled_by_the_rings_share_of_the_bytes():
    """A table timed on pairs prices a group of 4 from the pairs' times, scaled by what a ring moves of the data:
    (g - 1) / g = 3/4 against the pair's 1/2, 1.5 times the pair's time."""
    table = {"all_gather": {(2, 2, False): [[2**20, 0.001], [2**26, 0.100]]}}
    link = group_link(ParallelDims(dp_shard=4, world_size=4), ("dp_shard_mod_ep", "ep"), _measured(table))
    assert link.size == 4 and link.measured is not None
    assert ring_time(link, 2**26) == pytest.approx(1.5 * 0.100)
    assert ring_time(link, 2**20) == pytest.approx(1.5 * 0.001)


def test_under_a_pipeline_only_groups_within_a_stage_read_the_rows_timed_beside_compute():
    """Beside a pipeline a group inside one stage (tp, dp) communicates while the other stages compute: the rows
    timed with the job's other ranks computing; a group across the stages (pp: the step's gradient norm and loss
    terms) has every stage in it, the rows timed with every group communicating at once."""
    table = {"all_reduce": {(2, 4, False): [[4096, 0.001]], (2, 4, True): [[4096, 0.003]]}}
    dims, host = ParallelDims(pp=2, dp_shard=2, world_size=4), _measured(table)
    assert all_reduce_time(group_link(dims, ("pp",), host), 4096) == pytest.approx(0.001)
    assert all_reduce_time(group_link(dims, ("dp_shard_mod_ep", "ep"), host), 4096) == pytest.approx(0.003)


def test_a_group_between_two_timed_sizes_reads_the_larger_one():
    """Equally near two timed group sizes (2 and 4 for a group of 3), the larger group's rows price it, scaled by
    the ring's share (2/3 over 3/4)."""
    table = {"all_gather": {(2, 3, False): [[2**20, 0.001]], (4, 3, False): [[2**20, 0.004]]}}
    link = group_link(ParallelDims(dp_shard=3, world_size=3), ("dp_shard_mod_ep", "ep"), _measured(table, 3))
    assert ring_time(link, 2**20) == pytest.approx(0.004 * (2 / 3) / (3 / 4))


def test_a_single_member_group_all_reduces_nothing_even_with_a_timed_table():
    """A group of one moves no bytes: no call, 0 s, whatever a table of timed collectives holds."""
    table = {"all_reduce": {(1, 1, False): [[4096, 0.001]]}}
    link = group_link(ParallelDims(world_size=1), ("dp_shard_mod_ep", "ep"), _measured(table, 1))
    assert all_reduce_time(link, 4096) == 0.0


def test_a_sync_below_the_first_timed_compute_grows_from_nothing_and_stays_at_the_last_past_them():
    """sync_after_compute: linear from 0 s at no compute to the first timed point, linear between points (given in
    any order), the last point's value past them."""
    from optimus.plan.comms import sync_after_compute

    points = ((0.04, 0.003), (0.01, 0.001))
    assert sync_after_compute(points, 0.005) == pytest.approx(0.0005)
    assert sync_after_compute(points, 0.025) == pytest.approx(0.002)
    assert sync_after_compute(points, 1.0) == pytest.approx(0.003)
