"""Alpha-beta cost of collectives on a mesh dimension, with the link level set by the mesh order.

A collective over g ranks moving S bytes costs (g - 1) alpha + (g - 1) / g * S / beta (ring all-gather and
reduce-scatter: S is the gathered size; an all-reduce is both, twice that). Which link carries it follows
from where the group's ranks sit: ranks are numbered along the mesh (pp, dp_replicate, dp_shard_mod_ep, ep,
tp), outermost first, so tp neighbours are adjacent ranks and pp neighbours are far apart. A group whose
ranks span at most one node runs on the intra-node link; otherwise k of its members share each node and
every ring edge leaving a node shares the node's network bandwidth with the node's other rings:
beta = inter_node_bandwidth * k / devices_per_node (the slower of that and the intra-node link).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimus.parallel.mesh import MESH_DIMS, ParallelDims
from optimus.plan.cluster import Cluster


@dataclass(frozen=True)
class Link:
    """What one rank of a group sees: latency per hop (s), bandwidth per rank (B/s), members per node."""

    alpha: float
    beta: float
    per_node: int
    size: int


def mesh_sizes(dims: ParallelDims) -> dict[str, int]:
    """Each mesh dimension's size, in MESH_DIMS order (outermost first)."""
    return {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard_mod_ep": dims.dp_shard_mod_ep,
            "ep": dims.ep, "tp": dims.tp}


def group_link(dims: ParallelDims, group: tuple[str, ...], cluster: Cluster) -> Link:
    """The link a collective over the mesh dims `group` runs on."""
    sizes = mesh_sizes(dims)
    size = math.prod(sizes[d] for d in group)
    outer = min(group, key=MESH_DIMS.index)
    stride = math.prod(sizes[d] for d in MESH_DIMS[MESH_DIMS.index(outer) + 1:])
    span = stride * sizes[outer]  # consecutive ranks the group's members lie in
    n = cluster.devices_per_node
    intra = Link(cluster.intra_node_latency_us * 1e-6, cluster.intra_node_gb_s * 1e9, size, size)
    if span <= n or size == 1:
        return intra
    # members of the group that share a node: the inner dims of the group that fit in a node
    per_node = 1
    for d in reversed(MESH_DIMS):
        if d in group:
            inner = math.prod(sizes[x] for x in MESH_DIMS[MESH_DIMS.index(d) + 1:])
            if inner * sizes[d] <= n:
                per_node *= sizes[d]
            else:
                per_node *= max(1, n // inner) if inner < n else 1
                break
    per_node = max(1, min(per_node, size))
    beta = min(cluster.intra_node_gb_s * 1e9, cluster.inter_node_gb_s * 1e9 * per_node / n)
    return Link(cluster.inter_node_latency_us * 1e-6, beta, per_node, size)


def ring_time(link: Link, gathered_bytes: float) -> float:
    """All-gather or reduce-scatter of `gathered_bytes` (the full, gathered size) over the group."""
    g = link.size
    if g <= 1:
        return 0.0
    return (g - 1) * link.alpha + (g - 1) / g * gathered_bytes / link.beta


def all_reduce_time(link: Link, nbytes: float) -> float:
    """Ring all-reduce: a reduce-scatter and an all-gather."""
    return 2 * ring_time(link, nbytes)


def all_to_all_time(link: Link, send_bytes: float, cluster: Cluster) -> float:
    """All-to-all where each rank sends `send_bytes` in all, spread evenly over the group: the on-node
    share goes over the intra-node link, the off-node share over the rank's part of the node's network."""
    g = link.size
    if g <= 1:
        return 0.0
    on_node = send_bytes * (link.per_node - 1) / g
    off_node = send_bytes * (g - link.per_node) / g
    intra = cluster.intra_node_gb_s * 1e9
    inter = cluster.inter_node_gb_s * 1e9 / cluster.devices_per_node
    return (g - 1) * link.alpha + max(on_node / intra, off_node / inter if off_node else 0.0)


def p2p_time(link_alpha: float, beta: float, nbytes: float) -> float:
    """One point-to-point send."""
    return link_alpha + nbytes / beta
