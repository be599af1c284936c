"""Typed settings of a job's layout (the `parallel:` config section); no torch here, so a config loads fast.

`ParallelDegrees` is the one list of layout degrees: `ParallelConfig` adds how the layout runs
(schedules, dispatch, sharding), and `optimus.parallel.mesh.ParallelDims` adds the world size.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ParallelDegrees(BaseModel):
    """How many ways a job is split along each axis. Expert parallelism borrows its ranks from dp_shard."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    dp_replicate: int = Field(1, gt=0, description="replicated data parallelism (HSDP's outer dimension)")
    dp_shard: int = Field(1, gt=0, description="sharded data parallelism (FSDP2, or ZeRO-1/2: see shard_mode)")
    tp: int = Field(1, gt=0, description="tensor (and sequence) parallelism")
    pp: int = Field(1, gt=0, description="pipeline stages")
    ep: int = Field(1, gt=0, description="expert parallelism, taken from the dp_shard ranks (divides dp_shard)")

    @property
    def layout_ranks(self) -> int:
        """The ranks these degrees use: dp_replicate x dp_shard x tp x pp (ep lives inside dp_shard)."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp


class ParallelConfig(ParallelDegrees):
    """The degrees plus how the layout runs: pipeline schedule, expert dispatch, gradient sync, sharding."""

    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pp_virtual_stages: int = Field(1, gt=0)
    ep_dispatch: Literal["all_to_all", "allgather"] = "all_to_all"
    defer_grad_sync: Literal["none", "replicate", "all"] = Field(
        "replicate", description="gradient accumulation: reduce only after a step's last micro-batch over dp_replicate "
                                 "(HSDP's all-reduce), over every dp dim (all: unsharded gradients held meanwhile), or none")
    shard_mode: Literal["fsdp", "zero1", "zero2", "ddp"] = Field(
        "fsdp", description="fsdp: FSDP2 (ZeRO-3); zero1/zero2: whole parameters, sharded fp32 master + AdamW "
                            "state (optimus/optim/sharded.py), gradients reduce-scattered at the step / per bucket; "
                            "ddp: nothing sharded, torch DDP (pure data parallel, small models)")
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="the dtype gradients cross data-parallel ranks and are summed in: fp32 (the default: a "
                            "sum over many ranks loses nothing) or bf16 (half the bytes, as Megatron's "
                            "--grad-reduce-in-bf16, FSDP2's reduce_dtype and the Aurora team's bf16 gradient "
                            "buffers; each gradient and each partial sum rounded to bf16; FSDP also sums deferred "
                            "micro-batches in bf16). The reduced gradient is fp32 again before clipping and the "
                            "optimizer, whatever the mode")
    ep_aware: bool = Field(True, description="zero1/zero2: non-expert state sharded over DP x EP (False: over DP "
                                             "only, replicated across EP: the ablation baseline)")

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes per element of the gradients data parallelism reduces: 4 (fp32) or 2 (bf16)."""
        return 2 if self.grad_reduce_dtype == "bf16" else 4
