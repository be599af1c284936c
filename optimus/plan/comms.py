"""Alpha-beta cost of collectives on mesh dimensions, placed on the device hierarchy (device, node, network).

Placement. Ranks are numbered along the mesh (pp, dp_replicate, dp_shard_mod_ep, ep, tp), outermost first, and
consecutive ranks share a node (devices_per_node of them). A dimension's stride is the product of the sizes inside
it, so tp neighbours are adjacent ranks and pp neighbours far apart. A group over some dims has `per_node`
members on each node it touches (its inner dims that fit in a node) and spans `nodes = size / per_node` nodes.

Links. Inside a node a rank talks over the intra-node link (per device, per direction). Off the node every
device shares the node's NICs: collectives are SPMD, so while one group runs its inter-node phase the node's
other devices run theirs (the same collective over the other groups of that dim), and each device gets
inter_node_gb_s / max(devices_per_node, nics_per_node) -- never more than one NIC's worth.

Algorithms (what NCCL/RCCL/oneCCL pick for large messages, and the cheaper of the two where both apply):
    all-gather, reduce-scatter  hierarchical: intra-node phase over the per_node members, then an inter-node ring
                 over `nodes` of 1/per_node of the data (each local member carries its slice on its own NIC share);
                 or one flat ring over all members, paced by its slowest (inter-node) edge
    all-reduce   reduce-scatter + all-gather
    all-to-all   the on-node share of what a rank sends over the intra-node link, the off-node share over its NIC
                 share, concurrently (the slower bounds it)
    send/recv    one message, intra-node or over the NIC share
Every step of a ring pays the latency of its link (alpha per hop).

Measured instead of modelled: a cluster that carries a table of timed collectives (`here`: gloo over loopback,
optimus/plan/calibrate_collectives.py) answers an on-node collective from that table, interpolated in log-log
between the timed sizes (linear in bytes past the largest). A group smaller than the job is read from the rows timed
beside the job's other ranks computing where those ranks compute meanwhile, and from those timed with every group
communicating at once where they are in collectives of their own: beside a pipeline's other stages the first, else
the second. (Where ranks outnumber cores, stop 36 weighed the two by the share of the step the others compute, since
time slicing breaks the ranks' lockstep; the sync below prices that drift since stop 38, and with both the 4-rank
rows of benchmarks/plan_vs_measured.py read high: BENCHMARKS.md, stop 38.) Gloo's algorithms differ per operation
(its reduce-scatter of 64 MiB took twice its all-reduce's time on the 2-core EPYC) and slow down once a message
leaves the cache, which no single alpha-beta pair fits. A step reaches its collectives after compute, its ranks
apart, which the back-to-back calls of the table do not: each timed call adds the link's `sync`
(Cluster.collective_sync_s, which step_time sets; tensor parallelism's calls pay it at the compute before each
instead: block_collectives.TensorParallelGaps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimus.parallel.mesh import MESH_DIMS, ParallelDims
from optimus.plan.cluster import Cluster


@dataclass(frozen=True)
class Link:
    """Where a group's members sit and what they talk over.

    size: members; per_node: members on one node; nodes: nodes spanned. intra_*: the intra-node link (s, B/s per
    device); inter_*: the network as one device sees it while every device of its node communicates."""

    size: int
    per_node: int
    intra_alpha: float
    intra_beta: float
    inter_alpha: float
    inter_beta: float
    measured: dict[str, tuple[tuple[float, float], ...]] | None = None  # op -> ((bytes, seconds), ...), this size
    sync: float = 0.0  # with `measured`: what a call reached after compute adds to the table's (Cluster)

    @property
    def nodes(self) -> int:
        """Nodes the group spans."""
        return -(-self.size // self.per_node)

    @property
    def spans_nodes(self) -> bool:
        """True when some members are on different nodes."""
        return self.nodes > 1


def mesh_sizes(dims: ParallelDims) -> dict[str, int]:
    """Each mesh dimension's size, in MESH_DIMS order (outermost first)."""
    return {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard_mod_ep": dims.dp_shard_mod_ep,
            "ep": dims.ep, "tp": dims.tp}


def members_per_node(dims: ParallelDims, group: tuple[str, ...], devices_per_node: int) -> int:
    """How many members of a group over the mesh dims `group` share one node: walking the group's dims from the
    innermost, a dim whose whole extent (stride x size) fits in a node contributes all its members; the first
    that does not contributes the members that fit (node / stride, when its stride is below a node) and stops."""
    sizes = mesh_sizes(dims)
    per_node = 1
    for d in reversed(MESH_DIMS):
        if d not in group or sizes[d] == 1:
            continue
        stride = math.prod(sizes[x] for x in MESH_DIMS[MESH_DIMS.index(d) + 1:])
        if stride * sizes[d] <= devices_per_node:
            per_node *= sizes[d]
        else:
            if stride < devices_per_node:
                per_node *= max(1, devices_per_node // stride)
            break
    size = math.prod(sizes[d] for d in group)
    return max(1, min(per_node, size))


def nic_share(cluster: Cluster) -> float:
    """Network bandwidth (B/s, per direction) one device gets while all devices of its node use the NICs."""
    return cluster.inter_node_gb_s * 1e9 / max(cluster.devices_per_node, cluster.nics_per_node)


def group_link(dims: ParallelDims, group: tuple[str, ...], cluster: Cluster) -> Link:
    """The placement and links of a collective over the mesh dims `group`."""
    sizes = mesh_sizes(dims)
    beside_compute = _beside_compute(dims, group)
    key = (id(cluster), tuple(sizes.values()), group, beside_compute)
    known = _LINKS.get(key)
    if known is not None and known[0] is cluster:  # (the entry holds its cluster: no other one can take its id)
        return known[1]
    size = math.prod(sizes[d] for d in group)
    per_node = members_per_node(dims, group, cluster.devices_per_node)
    link = Link(size, per_node, cluster.intra_node_latency_us * 1e-6, cluster.intra_node_gb_s * 1e9,
                cluster.inter_node_latency_us * 1e-6, nic_share(cluster),
                _measured_for(cluster.measured_collectives, size, cluster.devices_per_node,
                              beside_compute=beside_compute)
                if size == per_node else None, cluster.collective_sync_s)
    if len(_LINKS) >= _MOST_LINKS:
        _LINKS.clear()
    _LINKS[key] = (cluster, link)
    return link


# group_link's answers by cluster (its id, with the cluster kept alive beside it), mesh and group: a search prices
# each of a job's few groups for tens of thousands of layouts, a dozen times each
_LINKS: dict[tuple, tuple[Cluster, Link]] = {}
_MOST_LINKS = 10_000  # a search of a preset keeps a few thousand (meshes x groups); `here` makes a cluster a layout


def _beside_compute(dims: ParallelDims, group: tuple[str, ...]) -> bool:
    """Whether a group over `group`'s dims reads the collectives timed beside compute: beside a pipeline's other
    stages (see the module)."""
    return dims.pp > 1 and "pp" not in group


def _measured_for(table: dict[str, dict[tuple[int, int, bool], list]] | None, size: int, job: int,
                  beside_compute: bool = False) -> dict[str, tuple] | None:
    """The timed points of each operation for a group of `size` in a job of `job` ranks: those timed for that
    group size in the nearest job size (here.collective_table's (members, job, others computed) groups: on a host
    with fewer cores than ranks a pair pays more inside a job of 4 than as a job of 2, and more again while the
    job's other ranks compute), the rows timed beside compute where `beside_compute`, else those timed with every
    group at once (either where only one was timed); else of the nearest timed group size with their bandwidth part
    rescaled by the ring's (g - 1) / g."""
    if not table:
        return None
    out = {}
    for op, by_group in table.items():
        if not by_group:
            continue

        members, _, _ = key = min(by_group, key=lambda g: (abs(g[0] - size), -g[0], abs(g[1] - job),
                                                           g[2] != beside_compute))
        points = {float(b): float(t) for b, t in by_group[key]}
        scale = ((size - 1) / size) / ((members - 1) / members) if members > 1 else 1.0
        out[op] = tuple(sorted((b, t * scale) for b, t in points.items()))
    return out


def _interpolate(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """Seconds for `nbytes` from timed (bytes, seconds) points: log-log between them, the smallest's time below
    them, proportional to bytes past the largest."""
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if nbytes <= b1:
            w = math.log(nbytes / b0) / math.log(b1 / b0)
            return math.exp((1 - w) * math.log(t0) + w * math.log(t1))
    b, t = points[-1]
    return t * nbytes / b


def _ring(members: int, alpha: float, beta: float, nbytes: float) -> float:
    """Ring all-gather / reduce-scatter of `nbytes` (gathered size) over `members` on one link."""
    if members <= 1:
        return 0.0
    return (members - 1) * alpha + (members - 1) / members * nbytes / beta


def ring_time(link: Link, gathered_bytes: float, op: str = "all_gather") -> float:
    """All-gather or reduce-scatter (`op`) of `gathered_bytes` (the full, gathered size) over the group: the
    cheaper of the hierarchical algorithm (intra-node phase, then inter-node over 1/per_node of the data) and a
    flat ring; the timed table where the cluster has one. Nothing to move is no call: 0 (a dense model's experts,
    the root unit's: a layout prices them apart and they have none)."""
    if link.size <= 1 or gathered_bytes <= 0:
        return 0.0
    if link.measured and op in link.measured:
        return _interpolate(link.measured[op], gathered_bytes) + link.sync
    intra = _ring(link.per_node, link.intra_alpha, link.intra_beta, gathered_bytes)
    if not link.spans_nodes:
        return intra
    hierarchical = intra + _ring(link.nodes, link.inter_alpha, link.inter_beta, gathered_bytes / link.per_node)
    # a flat ring crosses each node once per ring: the node's per_node members feed one inter-node edge, so that
    # edge gets per_node NIC shares (what the per_node local rings of the hierarchical scheme share between them)
    flat = _ring(link.size, link.inter_alpha, min(link.intra_beta, link.inter_beta * link.per_node), gathered_bytes)
    return min(hierarchical, flat)


def all_reduce_time(link: Link, nbytes: float) -> float:
    """All-reduce: a reduce-scatter and an all-gather (or the timed table); 0 for nothing."""
    if nbytes <= 0:
        return 0.0
    if link.size > 1 and link.measured and "all_reduce" in link.measured:
        return _interpolate(link.measured["all_reduce"], nbytes) + link.sync
    return ring_time(link, nbytes, "reduce_scatter") + ring_time(link, nbytes, "all_gather")


def all_to_all_time(link: Link, send_bytes: float, cluster: Cluster | None = None) -> float:
    """All-to-all where each rank sends `send_bytes` in all, spread evenly over the group (itself included): the
    on-node share over the intra-node link and the off-node share over the NIC share, at the same time.
    (`cluster` is accepted for older callers; the link carries everything needed.)"""
    g = link.size
    if g <= 1 or send_bytes <= 0:
        return 0.0
    if link.measured and "all_to_all" in link.measured:
        return _interpolate(link.measured["all_to_all"], send_bytes) + link.sync
    on_node = send_bytes * (link.per_node - 1) / g
    off_node = send_bytes * (g - link.per_node) / g
    latency = (link.per_node - 1) * link.intra_alpha + (g - link.per_node) * link.inter_alpha
    return latency + max(on_node / link.intra_beta, off_node / link.inter_beta if off_node else 0.0)


def send_time(link: Link, nbytes: float) -> float:
    """One point-to-point message to the next member of the group (a pipeline neighbour): over the intra-node link
    when the group keeps neighbours on one node, else over the NIC share (every stage sends at once)."""
    if link.size <= 1:
        return 0.0
    if link.spans_nodes:
        return link.inter_alpha + nbytes / link.inter_beta
    return link.intra_alpha + nbytes / link.intra_beta


# the groups the trainer communicates over (optimus/parallel/mesh.py's dims and flattened views)
GROUPS = (("tp", ("tp",)), ("ep", ("ep",)), ("dp_shard", ("dp_shard_mod_ep", "ep")),
          ("expert_dp", ("dp_replicate", "dp_shard_mod_ep")), ("dp", ("dp_replicate", "dp_shard_mod_ep", "ep")),
          ("dp_replicate", ("dp_replicate",)), ("pp", ("pp",)))


def placement(dims: ParallelDims, cluster: Cluster) -> dict[str, str]:
    """Where each communicating group of the layout sits: "intra-node (k)" or "k per node x n nodes" (size > 1)."""
    out = {}
    for name, group in GROUPS:
        link = group_link(dims, group, cluster)
        if link.size > 1:
            out[name] = (f"intra-node ({link.size})" if not link.spans_nodes
                         else f"{link.per_node} per node x {link.nodes} nodes")
    return out


def sync_after_compute(points: tuple[tuple[float, float], ...], compute_s: float) -> float:
    """Seconds a collective reached after `compute_s` of compute costs beyond the back-to-back call, from the timed
    (compute seconds, seconds) points: linear between them, the last one's past them, and below the first linear
    from nothing (no compute between two calls is the back-to-back call the collective table timed: dense TP 2
    summing four micro-batches, its calls about 3 ms of compute apart, measured 1.098 s and was priced 1.267 s at
    the 10 ms point's sync; so, 1.068 s against 1.047 measured)."""
    points = tuple(sorted(points))
    if compute_s <= points[0][0]:
        return points[0][1] * max(0.0, compute_s) / points[0][0] if points[0][0] > 0 else points[0][1]
    for (c0, s0), (c1, s1) in zip(points, points[1:]):
        if compute_s <= c1:
            return s0 + (s1 - s0) * (compute_s - c0) / (c1 - c0)
    return points[-1][1]
