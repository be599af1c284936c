"""Evaluation as a callback: held-out loss and the downstream tasks of `train.eval_tasks`, every
`train.eval_every` steps and at the last step, announced to the other callbacks as one record."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from optimus.data.loader import heldout_share
from optimus.eval.loop import downstream_accuracies
from optimus.parallel.pipeline import get_pipeline
from optimus.resilience.guards import NonFiniteHeldOutLoss
from optimus.train.callbacks.base import Callback
from optimus.train.evaluate import evaluate
from optimus.train.step import autocast_context

if TYPE_CHECKING:
    from optimus.train.trainer import Trainer


class Evaluation(Callback):
    """Every rank: the forwards of a sharded or pipelined model are collective."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.last_loss: float | None = None  # the held-out loss of this run segment's latest evaluation
        self._heldout = None

    def after_step(self, step: int) -> None:
        train = self.trainer.config.train
        if step == train.max_steps or (train.eval_every and step % train.eval_every == 0):
            self.last_loss = self.run(step)
            if self.last_loss is not None and not math.isfinite(self.last_loss):
                self._refuse_weights(step, self.last_loss)

    def _refuse_weights(self, step: int, loss: float) -> None:
        """Stop before this step's checkpoint: weights that give a non-finite held-out loss are not worth saving, and
        the skip guard would skip every later step (it stops only after resilience.max_consecutive_skips of them,
        so a shorter run used to end here with exit 0)."""
        skips = self.trainer.consecutive_skips.count
        why = f"; the last {skips} optimizer step(s) were skipped" if skips else ""
        raise NonFiniteHeldOutLoss(
            f"step {step}: the held-out loss is {loss} (the weights give non-finite losses{why}): check "
            "model.init_std and optim.lr, or resume from an earlier checkpoint with a lower optim.lr")

    def _dp_group(self):
        trainer = self.trainer
        return trainer.mesh["dp"].get_group() if trainer.mesh is not None and trainer.dims.dp > 1 else None

    def heldout(self):
        """This rank's share of the fixed held-out set used for every evaluation of this run: eval_batches global
        batches of windows whatever the layout (data/loader.heldout_share), split over the data-parallel ranks."""
        if self._heldout is None:
            trainer, t = self.trainer, self.trainer.config.train
            # the training data's split (trainer.py): rank r of the "dp" mesh dimension
            rank, size = (trainer.mesh.local_rank("dp"), trainer.dims.dp) if trainer.dims.dp > 1 else (0, 1)
            self._heldout = heldout_share(trainer.data.heldout, t.seq_len, t.global_batch_size, t.eval_batches,
                                          t.micro_batch_size, rank, size, trainer.config.model.vocab_size)
        return self._heldout

    def heldout_loss(self) -> float | None:
        """Held-out loss of the current weights (None when no source has a held-out split)."""
        trainer = self.trainer
        batches = self.heldout()
        if not batches:  # the same on every rank: the shares are equal
            return None
        pipeline = get_pipeline(trainer.model)  # PP: each rank holds only its stages' layers
        dtype = trainer.config.train.dtype
        group = self._dp_group()
        if pipeline is not None:
            return pipeline.evaluate_loss(batches, trainer.device, autocast_context(trainer.device, dtype),
                                          dp_group=group)
        result = evaluate(trainer.model, batches, trainer.device, dtype)
        if group is None:
            return result.loss
        # on the device: NCCL reduces device tensors only
        total = torch.tensor([result.loss * result.tokens, result.tokens], dtype=torch.float64, device=trainer.device)
        dist.all_reduce(total, group=group)
        return (total[0] / total[1].clamp(min=1)).item()

    def run(self, step: int) -> float | None:
        """Evaluate now and tell the other callbacks; returns the held-out loss."""
        trainer = self.trainer
        loss = self.heldout_loss()
        record = {"step": step} if loss is None else {"step": step, "eval_loss": loss}
        downstream = downstream_accuracies(trainer.model, trainer.config, trainer.device, trainer.mesh)
        if downstream:
            record["downstream"] = downstream
        if len(record) > 1:
            trainer.dispatch("on_eval", step, record)
        return loss
