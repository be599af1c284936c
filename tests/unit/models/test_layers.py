"""models/layers.py: RMSNorm's formula, and the configured norm_eps in every norm of a built model."""

from __future__ import annotations

import pytest
import torch

from optimus.models.config import ModelConfig
from optimus.models.layers import RMSNorm
from optimus.models.transformer import build_model


def test_rms_norm_adds_eps_to_the_mean_square_under_the_root():
    """y = w * x / sqrt(mean(x^2) + eps): x = (3, 4) has mean square 12.5, so with eps 3.5 the divisor is 4."""
    norm = RMSNorm(2, eps=3.5)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(norm(torch.tensor([[3.0, 4.0]])), torch.tensor([[0.75, 2.0]]))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_every_norm_of_the_model_uses_the_configured_eps(moe):
    """Two norms a block, its q and k norms (qk_norm) and the final one, all at model.norm_eps: a norm left at the
    default 1e-5 moves the logits by less than the parity tests' tolerance, so it is checked by name here."""
    extra = dict(n_experts=4, top_k=2, expert_ffn_hidden=16) if moe else dict(n_experts=0, ffn_hidden=32)
    config = ModelConfig(d_model=32, n_layers=2, n_heads=2, vocab_size=64, norm_eps=3e-6, **extra)
    model = build_model(config, device="meta")
    norms = {name: module.eps for name, module in model.named_modules() if isinstance(module, RMSNorm)}
    assert len(norms) == 4 * config.n_layers + 1, sorted(norms)
    assert set(norms.values()) == {3e-6}, norms
