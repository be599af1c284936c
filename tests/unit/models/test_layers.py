"""models/layers.py: RMSNorm's formula, the configured norm_eps in every norm of a built model, and RoPE's
rotation (its convention, and that attention scores see only relative positions)."""

from __future__ import annotations

import pytest
import torch

from optimus.models.config import ModelConfig
from optimus.models.layers import RMSNorm, apply_rotary, rotary_cos_sin
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


def test_rope_rotates_each_pair_half_a_head_apart_by_position_times_its_frequency():
    """The rotate-half convention of Llama/OLMoE (what HF checkpoints expect): dimension i pairs with i + d/2, and
    pair i turns by position x theta^(-2i/d). Worked by hand for d = 4, theta = 100: frequencies 1 and 0.1."""
    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]] * 3]])  # [batch 1, heads 1, seq 3, head_dim 4]
    cos, sin = rotary_cos_sin(3, 4, 100.0, torch.device("cpu"), torch.float32)
    out = apply_rotary(x, cos, sin)[0, 0]
    assert torch.equal(out[0], x[0, 0, 0])  # position 0: no turn
    p = 2.0
    a, b = torch.tensor(p * 1.0), torch.tensor(p * 0.1)
    expected = torch.stack([1 * a.cos() - 3 * a.sin(), 2 * b.cos() - 4 * b.sin(),
                            3 * a.cos() + 1 * a.sin(), 4 * b.cos() + 2 * b.sin()])
    torch.testing.assert_close(out[2], expected)


def test_rope_scores_depend_on_relative_positions_only():
    """<R_m q, R_n k> = <R_(m+s) q, R_(n+s) k>: a query and key moved together score the same (and a rotation keeps
    each vector's length)."""
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)
    cos, sin = rotary_cos_sin(32, 8, 10000.0, torch.device("cpu"), torch.float64)

    def at(v: torch.Tensor, position: int) -> torch.Tensor:
        placed = torch.zeros(1, 1, 32, 8, dtype=torch.float64)
        placed[0, 0, position] = v
        return apply_rotary(placed, cos, sin)[0, 0, position]
    score = at(q, 7) @ at(k, 3)
    for shift in (1, 5, 20):
        torch.testing.assert_close(at(q, 7 + shift) @ at(k, 3 + shift), score)
    assert not torch.allclose(at(q, 7) @ at(k, 4), score)  # another distance scores otherwise
    torch.testing.assert_close(at(q, 11).norm(), q.double().norm())
