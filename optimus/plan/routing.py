"""An MoE's routing as the planner prices it: balanced, one figure for every layout, or the expert counts a run
logged, split as each planned layout splits the experts.

Dropless routing is never even, and how uneven it is for a layout depends on the layout: the ep x tp ranks that
split the experts each own a contiguous block of them (train/metrics.busiest_block_share), so one rank holding
every expert sees no imbalance at all while 64 shards of 64 experts see each expert's own. `--moe-imbalance X`
prices one figure wherever experts are split; `--moe-routing RUN` reads the counts RUN logged (every logged
step's token copies per expert and layer, summed over its data-parallel ranks) and gives each layout the shares
its own split would have had, over the last LOGGED_STEPS logged steps (the router settles as training goes on):

    memory  for the first and the last pipeline stage (whose ranks the memory model's peak is), the largest over
            those steps of the busiest block's share of the stage's token copies summed over its layers (the same
            rank holds that block in every layer, and the kept activations add up), or in the stage's worst layer
            where one block is recomputed at a time (full or selective checkpointing): the peak is the worst step's
    time    the mean over those steps of the slowest stage's layers' mean of each layer's busiest block share
            (each layer's exchange or tensor-parallel sum waits for its busiest rank; the trainer logs it as
            expert_rank_load_mean): a run's time is the sum of its steps

The counts are global: where ep is smaller than the data-parallel ranks a rank's own exchange group sees only its
group's tokens, which this cannot tell apart (a sum evens out what differs between groups, so it reads low). The
trainer reads the groups apart for the run's own layout (expert_rank_load_mean, and the `--moe-imbalance` its last
line gives).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from optimus.config import Config, ConfigError
from optimus.parallel.mesh import ParallelDims
from optimus.parallel.pipeline import rank_layers
from optimus.train.metrics import busiest_block_share

LOGGED_STEPS = 1000  # the last this many logged steps count (and bound the memory a long run's log takes)


class RoutingError(ConfigError):
    """A run whose logged routing cannot price this plan (one line, with the fix)."""


@dataclass
class LoggedRouting:
    """Token copies per expert a run logged: [steps, layers, experts], and where they came from."""

    counts: torch.Tensor
    source: str
    _cache: dict[tuple, tuple[dict[int, float], float]] = field(default_factory=dict, repr=False)

    @classmethod
    def read(cls, run: str | Path) -> LoggedRouting:
        """The routing of `run` (a run folder or its metrics.jsonl), or RoutingError."""
        from optimus.train.callbacks.jsonl import last_records

        path = Path(run)
        if not path.exists():
            raise RoutingError(f"--moe-routing {run}: no such run folder or file (give a run folder `optimus train` "
                               f"wrote, or its metrics.jsonl)")
        metrics = path / "metrics.jsonl" if path.is_dir() else path
        if not metrics.is_file():
            raise RoutingError(f"--moe-routing {run}: no {metrics} (give a run folder `optimus train` wrote, or its "
                               f"metrics.jsonl)")
        routing = cls.of_records(last_records(metrics, LOGGED_STEPS, '"expert_counts"'), str(run))
        if routing is None:
            raise RoutingError(f"--moe-routing {run}: {metrics} logged no expert counts (a dense model's run, or one "
                               f"stopped before its first logged step): give an MoE run's folder")
        return routing

    @classmethod
    def of_records(cls, records: list[dict], source: str) -> LoggedRouting | None:
        """The routing in a run's metrics records (None where none has expert counts), or RoutingError."""
        steps = [r["expert_counts"] for r in records if r.get("expert_counts")]
        if not steps:
            return None
        try:
            counts = torch.tensor(steps[-LOGGED_STEPS:], dtype=torch.float64)
        except (TypeError, ValueError):
            counts = None
        # a count that is not a finite number of 0 or more (NaN, from a damaged log) would price as balanced
        if counts is None or counts.dim() != 3 or not ((counts >= 0) & counts.isfinite()).all():
            raise RoutingError(f"--moe-routing {source}: its expert_counts are not [layer][expert] counts of one "
                               f"shape: is it a metrics.jsonl `optimus train` wrote?")
        return cls(counts, source)

    @property
    def steps(self) -> int:
        return self.counts.shape[0]

    def check_model(self, config: Config) -> None:
        """RoutingError unless the counts are of `config`'s model: as many MoE layers and experts."""
        m = config.model
        layers, experts = self.counts.shape[1:]
        if not m.is_moe:
            raise RoutingError(f"--moe-routing prices an MoE's routing: this config's model is dense "
                               f"(model.n_experts is 0); drop the flag")
        if (layers, experts) != (m.n_layers, m.n_experts):
            raise RoutingError(f"--moe-routing {self.source} logged {layers} layers of {experts} experts; this "
                               f"model has {m.n_layers} of {m.n_experts}: give a run of the same model shape, or "
                               f"--moe-imbalance X with the share its routing had")

    def shares(self, config: Config, dims: ParallelDims) -> tuple[dict[int, float], float]:
        """({first and last pipeline stage: its activations' share}, the step time's share) for this layout (see
        the module)."""
        blocks = dims.ep * dims.tp
        virtual = config.parallel.pp_virtual_stages if dims.pp > 1 else 1
        one_block = config.train.activation_checkpointing in ("full", "selective")
        key = (blocks, dims.pp, virtual, one_block)
        if key not in self._cache:
            self._cache[key] = self._shares(blocks, dims.pp, virtual, one_block)
        return self._cache[key]

    def _shares(self, blocks: int, pp: int, virtual: int, one_block: bool) -> tuple[dict[int, float], float]:
        if blocks == 1:  # one rank holds every expert: nothing to wait for
            return dict.fromkeys({0, pp - 1}, 1.0), 1.0
        per_layer = busiest_block_share(self.counts, blocks)  # [steps, layers]
        layers = self.counts.shape[1]
        memory, paced = {}, []
        for stage in range(pp):
            index = rank_layers(layers, pp, virtual, stage)
            paced.append(per_layer[:, index].mean(dim=1))
            if stage not in (0, pp - 1):  # the memory model's peak is the first or last stage's (plan/memory.py)
                continue
            if one_block:
                kept = per_layer[:, index].amax(dim=1)
            else:  # the stage's copies summed over its layers, split into the same blocks
                kept = busiest_block_share(self.counts[:, index].sum(dim=1), blocks)
            memory[stage] = kept.max().item()
        return memory, torch.stack(paced).amax(dim=0).mean().item()


Routing = float | LoggedRouting  # --moe-imbalance's one figure (1.0: balanced), or a run's logged counts


def layout_imbalance(routing: Routing, config: Config, dims: ParallelDims) -> tuple[float | dict[int, float], float]:
    """(the memory model's routing_imbalance: one figure or one per pipeline stage, the step time's); 1.0 where
    one rank holds every expert (no ep or tp split): it waits for no other."""
    if isinstance(routing, LoggedRouting):
        return routing.shares(config, dims)
    return (routing, routing) if dims.ep * dims.tp > 1 else (1.0, 1.0)
