"""models/moe.py: the router's outputs and the two router loss terms, checked against their formulas by hand."""

from __future__ import annotations

import torch

from optimus.models.config import ModelConfig
from optimus.models.transformer import build_model

CONFIG = ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=64, n_experts=8, top_k=2, expert_ffn_hidden=16)


def _moe_and_tokens(seed: int = 0):
    moe = build_model(CONFIG, seed=seed).layers["0"].mlp
    with torch.no_grad():  # router logits of order one (init_std 0.02 leaves them near zero, and log Z near log E)
        moe.router.weight.mul_(50.0)
    tokens = torch.randn(24, CONFIG.d_model, generator=torch.Generator().manual_seed(seed))
    return moe, tokens


def test_z_loss_is_the_mean_over_tokens_of_the_squared_log_partition():
    """ST-MoE's router z-loss: (1/T) sum_t (log sum_e exp(logit_te))^2, from the logits in float64."""
    moe, tokens = _moe_and_tokens()
    _, stats = moe(tokens)
    logits = tokens.double() @ moe.router.weight.double().t()
    want = logits.exp().sum(dim=1).log().pow(2).mean()
    # fp32 logits and logsumexp against float64: a relative 1e-5 is ~100 ulps of headroom
    torch.testing.assert_close(stats.z_loss.double(), want, rtol=1e-5, atol=0)


def test_the_load_balancing_loss_trains_the_router_through_its_probabilities():
    """aux = E * sum_e f_e * P_e: f_e (the share of token copies routed to e) is a count, constant; P_e (the mean
    router probability of e) carries the gradient. The router's gradient is that of the formula with f held fixed;
    a detached P would leave the router with none from this term."""
    moe, tokens = _moe_and_tokens()
    _, stats = moe(tokens)
    got = torch.autograd.grad(stats.aux_loss, moe.router.weight)[0]
    weight = moe.router.weight.detach().clone().requires_grad_()
    probs = torch.softmax(tokens @ weight.t(), dim=-1)
    ids = probs.topk(CONFIG.top_k, dim=-1).indices
    share = torch.bincount(ids.flatten(), minlength=CONFIG.n_experts).float() / tokens.shape[0]
    want = torch.autograd.grad(CONFIG.n_experts * (share * probs.mean(dim=0)).sum(), weight)[0]
    assert want.abs().max() > 1e-3  # a gradient worth comparing
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)  # fp32, the same ops in another order


def test_router_probabilities_are_fp32_under_bf16_autocast():
    """As OLMoE computes them: the softmax over experts in fp32 even when the router matmul runs in bf16."""
    moe, tokens = _moe_and_tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, probs, top_weights, _ = moe.router(tokens)
    assert logits.dtype == torch.bfloat16 and probs.dtype == torch.float32
    # the fp32 softmax of the bf16 logits, exactly (a bf16 softmax would round each probability to 8 bits)
    torch.testing.assert_close(probs, torch.softmax(logits.float(), dim=-1), rtol=1e-6, atol=1e-7)
