"""Held-out evaluation: mean cross-entropy, perplexity and bits per byte."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from optimus.train.step import MicroBatch, autocast_context


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy in nats per token
    tokens: int
    bytes: int | None = None  # UTF-8 bytes the evaluated tokens decode to, when known

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))

    @property
    def bits_per_byte(self) -> float | None:
        if not self.bytes:
            return None
        return self.loss * self.tokens / math.log(2) / self.bytes


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: list[MicroBatch], device: torch.device, dtype: str = "fp32", tokenizer=None
) -> EvalResult:
    """Token-weighted mean cross-entropy over the batches (model switched to eval mode and back)."""
    was_training = model.training
    model.eval()
    total_nats, total_tokens, total_bytes = 0.0, 0, 0
    for inputs, labels in batches:
        with autocast_context(device, dtype):
            out = model(inputs.to(device), labels.to(device))
        total_nats += out.ce_loss.item() * labels.numel()
        total_tokens += labels.numel()
        if tokenizer is not None:
            total_bytes += sum(len(tokenizer.decode(row.tolist()).encode("utf-8")) for row in labels)
    model.train(was_training)
    return EvalResult(loss=total_nats / max(total_tokens, 1), tokens=total_tokens, bytes=total_bytes or None)
