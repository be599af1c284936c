"""The alpha-beta collective model (plan/comms.py) priced by hand: each term (latency per hop, bytes over the link,
the hierarchical and the flat ring, all-to-all's on- and off-node shares, a pipeline send) checked on its own."""

from __future__ import annotations

import pytest

from optimus.plan.comms import Link, all_reduce_time, all_to_all_time, ring_time, send_time

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
