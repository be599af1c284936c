"""Autoregressive sampling: greedy by default, temperature sampling when temperature > 0."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend input_ids [1, S] by up to max_new_tokens; returns only the new tokens [1, N].

    Recomputes the full prefix each step (no KV cache): exact, and fast enough for the small
    models and short continuations this serves (samples, parity checks).
    """
    model.eval()
    ids = input_ids
    new_tokens = []
    for _ in range(max_new_tokens):
        logits = model(ids).logits[:, -1, :].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
        else:
            next_id = logits.argmax(dim=-1, keepdim=True)
        new_tokens.append(next_id)
        ids = torch.cat([ids, next_id], dim=1)
        if eos_id is not None and int(next_id) == eos_id:
            break
    return torch.cat(new_tokens, dim=1) if new_tokens else ids[:, :0]
