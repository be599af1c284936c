"""Stateful wrappers: what a checkpoint holds, each piece saved and restored through DCP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    StateDictOptions,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelState(Stateful):
    """Model weights (full or sharded: DCP reshards on load).

    optimizer_key: the entry under which the optimizer is checkpointed beside it ("optimizer").
    """

    def __init__(self, model: nn.Module, optimizer_key: str = "optimizer"):
        self.model = model
        self.optimizer_key = optimizer_key

    def better_sources(self) -> dict[str, str]:
        """For CheckpointManager.load: keys of state_dict() to read from another checkpoint key where the checkpoint
        has it. A model whose weights are fp32 (fsdp, ddp, one process) resuming a bf16 zero1/zero2 run: that run's
        parameters were saved in bf16, its fp32 master weights beside them; the masters are the weights."""
        if any(p.dtype != torch.float32 for p in self.model.parameters()):
            return {}  # bf16 weights (zero modes): their masters live in the optimizer, which loads them itself
        from optimus.parallel.parallelize import single_process_name

        return {key: f"{self.optimizer_key}.state.{single_process_name(key)}.master" for key in self.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


# Flattened ("state.<param>.exp_avg", "param_groups.<param>.lr"): every entry is keyed by a parameter
# name, so ranks holding different parameters (pipeline stages) save and load their own hyperparameters.
# Nested param_groups are one list per rank and DCP keeps only one rank's, which breaks PP resume.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizerState(Stateful):
    """Optimizer moments and step counts, keyed by parameter name so they survive resharding.

    model_key: the entry under which the model's ModelState is checkpointed beside it ("model").
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_key: str = "model"):
        self.model = model
        self.optimizer = optimizer
        self.model_key = model_key

    def stand_ins(self) -> dict[str, str]:
        """For CheckpointManager.load: keys of state_dict() a checkpoint may lack, with the checkpoint key read
        instead. A bf16 zero1/zero2 optimizer's fp32 master weights: an fsdp (or fp32) run saved none, but
        its parameters are those fp32 weights."""
        if not _is_sharded(self.optimizer):
            return {}
        return {key: f"{self.model_key}.{name}" for key, name in self.optimizer.master_weight_keys().items()}

    def state_dict(self) -> dict[str, Any]:
        if _is_sharded(self.optimizer):  # zero1/zero2 write the same flattened, per-parameter form
            return self.optimizer.state_dict()
        return get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _is_sharded(self.optimizer):
            self.optimizer.load_state_dict(state_dict)
            return
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=_FLAT)


def _is_sharded(optimizer: Any) -> bool:
    from optimus.optim.sharded import ShardedOptimizer

    return isinstance(optimizer, ShardedOptimizer)


class ProgressState(Stateful):
    """Where training stands: the last completed step and the tokens seen so far."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class RNGState(Stateful):
    """The global torch CPU generator (identical on every rank: all seed it the same way)."""

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["cpu"])


class LoaderState(Stateful):
    """The data loader's position, stored as tensors (no pickled objects in a checkpoint)."""

    def __init__(self, loader: Any):
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return {key: torch.tensor(value) for key, value in self.loader.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict({key: int(value) for key, value in state_dict.items()})
