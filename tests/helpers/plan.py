"""A cluster whose numbers the planner tests price by hand: an H100's peaks, 100 GB/s and 5 us within a node, 40 GB/s
and 10 us across nodes, 3,000 GB/s of memory, 1 kW a node at PUE 1 on a carbon-free grid."""

from __future__ import annotations

from dataclasses import replace

from optimus.plan.cluster import Cluster

TOY_CLUSTER = Cluster(name="toy", device="H100", devices_per_node=8, memory_gb=80, hbm_gb_s=3000, intra_node_gb_s=100,
                      intra_node_latency_us=5, inter_node_gb_s=40, inter_node_latency_us=10, node_power_kw=1, pue=1.0,
                      grid_kgco2_per_kwh=0.0)


def toy_cluster(**changes) -> Cluster:
    """TOY_CLUSTER with `changes` (devices_per_node=4, a slower link...)."""
    return replace(TOY_CLUSTER, **changes)
