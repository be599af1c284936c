"""ParallelDims: the parallel degrees of a job, validated, and the one named DeviceMesh built from them.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard_mod_ep, ep, tp. Expert parallelism
borrows its ranks from dp_shard (EP ranks are data-parallel for every non-expert weight, as in
Optimus and torchtitan), so dp_shard = dp_shard_mod_ep * ep. Flattened views:
    dp        = dp_replicate x dp_shard_mod_ep x ep   (data loading: who gets which samples)
    dp_shard  = dp_shard_mod_ep x ep                   (FSDP of non-expert weights)
    dp_mod_ep = dp_replicate x dp_shard_mod_ep          (replicas of one expert shard)
Nothing else in Optimus creates process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from optimus.config import ConfigError
from optimus.models.config import ModelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")


class LayoutError(ConfigError):
    """Parallel degrees that do not fit the world, the model or the batch (one-line message with the fix).
    All layout rules are gathered in optimus.parallel.validate.validate_layout."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "ep", "world_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel.{name} must be >= 1 (got {getattr(self, name)})")
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp
        if product != self.world_size:
            raise LayoutError(
                f"parallel.dp_replicate x dp_shard x tp x pp = {self.dp_replicate} x {self.dp_shard} x {self.tp} x "
                f"{self.pp} = {product}, but the job has {self.world_size} ranks: make the product equal the world size"
            )
        if self.dp_shard % self.ep:
            raise LayoutError(
                f"parallel.ep ({self.ep}) must divide parallel.dp_shard ({self.dp_shard}): expert-parallel ranks are "
                f"taken from the sharded data-parallel ranks"
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def check_model(self, model: ModelConfig, virtual_stages: int = 1, seq_len: int | None = None) -> None:
        """Raise LayoutError when the model (and, given, the training sequence length) cannot be split this way."""
        if model.n_heads % self.tp or model.kv_heads % self.tp:
            raise LayoutError(
                f"parallel.tp ({self.tp}) must divide model.n_heads ({model.n_heads}) and n_kv_heads ({model.kv_heads})"
            )
        if seq_len is not None and self.tp > 1 and seq_len % self.tp:
            raise LayoutError(
                f"train.seq_len ({seq_len}) must be a multiple of parallel.tp ({self.tp}): sequence parallelism "
                f"splits the sequence over the tp ranks"
            )
        stages = self.pp * virtual_stages
        if model.n_layers < stages:
            raise LayoutError(
                f"model.n_layers ({model.n_layers}) is fewer than the pipeline stages (pp x virtual stages = {stages})"
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
        shape = (self.pp, self.dp_replicate, self.dp_shard_mod_ep, self.ep, self.tp)
        world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        flattened = {
            "dp": world["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp"),
            "dp_shard": world["dp_shard_mod_ep", "ep"]._flatten("dp_shard"),
            "dp_mod_ep": world["dp_replicate", "dp_shard_mod_ep"]._flatten("dp_mod_ep"),
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
