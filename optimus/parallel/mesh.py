"""ParallelDims: the parallel degrees of a job, validated, and the one named DeviceMesh built from them.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard_mod_ep, ep, tp. Expert parallelism
borrows its ranks from dp_shard (EP ranks are data-parallel for every non-expert weight, as in
Optimus and torchtitan), so dp_shard = dp_shard_mod_ep * ep. Flattened views:
    dp        = dp_replicate x dp_shard_mod_ep x ep   (data loading: who gets which samples)
    dp_shard  = dp_shard_mod_ep x ep                   (FSDP of non-expert weights)
    expert_dp = dp_replicate x dp_shard_mod_ep          (data parallelism of expert weights: the ranks
                                                         holding the same experts, which average their grads)
Nothing else in Optimus creates process groups.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ConfigDict, Field, ValidationError

from optimus.config import ConfigError
from optimus.models.config import ModelConfig
from optimus.parallel.config import ParallelDegrees

# torch is imported only where a mesh is built: every Config validates its layout with this module, and
# loading a config (examples/launch/run_finished.py) then costs no torch start-up
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")


class LayoutError(ConfigError):
    """Parallel degrees that do not fit the world, the model or the batch (one-line message with the fix).
    All layout rules are gathered in optimus.parallel.validate.validate_layout."""


class ParallelDims(ParallelDegrees):
    """The layout degrees (fields of ParallelDegrees, the one list of them) for a job of `world_size` ranks,
    checked to fit that world. Build it from a config with `ParallelDims.from_config(config.parallel, world)`."""

    model_config = ConfigDict(frozen=True)

    world_size: int = Field(1, gt=0)

    def __init__(self, **degrees: int) -> None:
        try:
            super().__init__(**degrees)
        except ValidationError as err:
            first = err.errors()[0]
            raise LayoutError(f"parallel.{first['loc'][0]}: {first['msg']} (got {first.get('input')!r})") from None
        if self.layout_ranks != self.world_size:
            raise LayoutError(
                f"parallel.dp_replicate x dp_shard x tp x pp = {self.dp_replicate} x {self.dp_shard} x {self.tp} x "
                f"{self.pp} = {self.layout_ranks}, but the job has {self.world_size} ranks: make the product equal "
                f"the world size"
            )
        if self.dp_shard % self.ep:
            raise LayoutError(
                f"parallel.ep ({self.ep}) must divide parallel.dp_shard ({self.dp_shard}): expert-parallel ranks are "
                f"taken from the sharded data-parallel ranks"
            )

    @classmethod
    def from_config(cls, parallel: ParallelDegrees, world_size: int | None = None) -> "ParallelDims":
        """The degrees of `parallel` (a ParallelConfig) for `world_size` ranks (default: the ranks they use)."""
        degrees = {name: getattr(parallel, name) for name in ParallelDegrees.model_fields}
        return cls(**degrees, world_size=parallel.layout_ranks if world_size is None else world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (data parallelism of expert weights): dp_replicate x dp_shard_mod_ep."""
        return self.dp_replicate * self.dp_shard_mod_ep

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def has_data_parallel(self) -> bool:
        """Whether several ranks share the batch (FSDP, zero or DDP then has ranks to shard or average over)."""
        return self.dp > 1

    def check_model(self, model: ModelConfig, virtual_stages: int = 1, seq_len: int | None = None) -> None:
        """Raise LayoutError when the model (and, given, the training sequence length) cannot be split this way."""
        if model.n_heads % self.tp or model.kv_heads % self.tp:
            raise LayoutError(
                f"parallel.tp ({self.tp}) must divide model.n_heads ({model.n_heads}) and n_kv_heads ({model.kv_heads}): "
                f"use a tp that divides {math.gcd(model.n_heads, model.kv_heads)}"
            )
        if seq_len is not None and self.tp > 1 and seq_len % self.tp:
            raise LayoutError(
                f"train.seq_len ({seq_len}) must be a multiple of parallel.tp ({self.tp}): sequence parallelism "
                f"splits the sequence over the tp ranks"
            )
        stages = self.pp * virtual_stages
        if model.n_layers < stages:
            raise LayoutError(
                f"model.n_layers ({model.n_layers}) is fewer than the pipeline stages (pp x virtual stages = {stages}): "
                "lower parallel.pp (or parallel.pp_virtual_stages)"
            )
        if self.ep > 1 and not model.is_moe:
            raise LayoutError(f"parallel.ep ({self.ep}) needs an MoE model (model.n_experts > 0): set parallel.ep=1")
        if model.is_moe and model.n_experts % self.ep:
            raise LayoutError(f"parallel.ep ({self.ep}) must divide model.n_experts ({model.n_experts})")
        if model.is_moe and self.tp > 1 and model.n_experts % (self.ep * self.tp):
            raise LayoutError(
                f"parallel.ep x tp ({self.ep} x {self.tp}) must divide model.n_experts ({model.n_experts}): under "
                f"tensor parallelism each tp rank owns n_experts / (ep x tp) experts; lower tp or ep, or change "
                f"model.n_experts"
            )

    def build_mesh(self, device_type: str) -> "ParallelMesh":
        """The job's DeviceMesh with every dimension named, plus its flattened views."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.ep, self.tp)
        world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        flattened = {
            "dp": world["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp"),
            "dp_shard": world["dp_shard_mod_ep", "ep"]._flatten("dp_shard"),
            "expert_dp": world["dp_replicate", "dp_shard_mod_ep"]._flatten("expert_dp"),
        }
        return ParallelMesh(world, flattened)


@dataclass
class ParallelMesh:
    """The world mesh and its flattened views; `mesh["tp"]` or `mesh["dp"]` gives a 1-D mesh."""

    world: DeviceMesh
    flattened: dict[str, DeviceMesh]

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, str) and name in self.flattened:
            return self.flattened[name]
        return self.world[name]

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()
