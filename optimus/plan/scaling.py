"""Scaling efficiency against a smaller run: `optimus plan ... --devices N --scaling-from M`.

The smaller run is the planner's best fitting layout of the same config on M devices: under strong scaling with
the same global batch (the work of a step is fixed, its time should fall by N / M), under weak scaling with the
global batch cut by M / N (each device keeps its sequences a step). Either way the efficiency of a layout on N
devices is its tokens per second per device over the smaller run's: 1.0 is linear scaling. This is how the
published figures are stated (Frontier's 89% and 87% strong scaling, the Aurora team's ~90% 384 -> 12,288 tiles:
optimus/plan/published.py reads them the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from optimus.config import Config, ConfigError
from optimus.plan.cluster import Cluster
from optimus.plan.efficiency import Efficiency
from optimus.plan.routing import Routing
from optimus.plan.search import Candidate, plan

Scaling = Literal["strong", "weak"]


@dataclass
class SmallerRun:
    """The baseline: its devices, how the batch scaled, and its best fitting layout (None: none fits)."""

    devices: int
    scaling: Scaling
    global_batch_size: int
    best: Candidate | None

    def efficiency(self, candidate: Candidate, devices: int) -> float | None:
        """`candidate`'s (on `devices` devices) tokens/s per device over the baseline's; None without a baseline."""
        if self.best is None:
            return None
        return candidate.tokens_per_s / devices / (self.best.tokens_per_s / self.devices)


def smaller_config(config: Config, devices: int, smaller: int, scaling: Scaling) -> Config:
    """`config` as the smaller run trains it: the same global batch (strong), or cut by smaller / devices (weak)."""
    if not 1 <= smaller < devices:
        raise ConfigError(f"--scaling-from {smaller}: the smaller run needs between 1 and {devices - 1} devices "
                          f"(fewer than --devices {devices})")
    if scaling == "strong":
        return config
    batch, rest = divmod(config.train.global_batch_size * smaller, devices)
    if rest or batch < 1:
        raise ConfigError(f"--scaling weak from {smaller} devices: train.global_batch_size "
                          f"{config.train.global_batch_size} x {smaller} / {devices} is not a whole number of "
                          f"sequences: choose device counts whose ratio divides the batch")
    return config.model_copy(update={"train": config.train.model_copy(update={"global_batch_size": batch})})


def smaller_run(config: Config, cluster: Cluster, devices: int, smaller: int, scaling: Scaling,
                efficiency: Efficiency | None = None, only: dict[str, frozenset[str]] | None = None,
                routing: Routing = 1.0) -> SmallerRun:
    """Plan the smaller run (`cluster` priced for its `smaller` devices) and keep its best fitting layout."""
    small = smaller_config(config, devices, smaller, scaling)
    best = next((c for c in plan(small, cluster, smaller, efficiency, only, routing) if c.fits), None)
    return SmallerRun(smaller, scaling, small.train.global_batch_size, best)
