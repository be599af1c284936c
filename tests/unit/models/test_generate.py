"""models/generate.py: greedy decoding takes the last position's largest logit; sampling follows softmax(logits / T)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from optimus.models.generate import generate


class FixedLogits(nn.Module):
    """Whatever the prefix, the next token's logits are [2, 0] (token 0 is e^2 times as likely as token 1 at T = 1);
    earlier positions prefer token 1, so reading the wrong position shows."""

    def forward(self, ids: torch.Tensor):
        logits = torch.tensor([0.0, 5.0]).expand(ids.shape[0], ids.shape[1], 2).clone()
        logits[:, -1] = torch.tensor([2.0, 0.0])
        return SimpleNamespace(logits=logits)


def test_greedy_takes_the_last_positions_largest_logit():
    assert generate(FixedLogits(), torch.tensor([[1, 1]]), max_new_tokens=5).tolist() == [[0] * 5]


@pytest.mark.parametrize("temperature, share", [(0.1, 1.0), (1.0, 0.8808), (10.0, 0.5498)])
def test_sampling_follows_the_softmax_at_its_temperature(temperature, share):
    """share: softmax(2 / T, 0)'s first entry; over 2,000 draws its standard error is at most 0.011."""
    drawn = generate(FixedLogits(), torch.tensor([[1]]), max_new_tokens=2000, temperature=temperature,
                     generator=torch.Generator().manual_seed(0))
    assert (drawn == 0).float().mean().item() == pytest.approx(share, abs=0.05)


def test_generation_stops_at_eos():
    assert generate(FixedLogits(), torch.tensor([[1]]), max_new_tokens=5, eos_id=0).tolist() == [[0]]
