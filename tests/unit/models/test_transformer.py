import pytest
import torch
import torch.nn.functional as F

from optimus.models.config import ModelConfig
from optimus.models.flops import count_parameters, flops_per_token
from optimus.models.presets import PRESETS
from optimus.models.transformer import build_model

TINY_MOE = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=512, n_experts=8, top_k=2, expert_ffn_hidden=32)
TINY_DENSE = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, n_experts=0, ffn_hidden=96,
                         norm_placement="post")


@pytest.mark.parametrize(
    "preset, total, active",
    [
        ("olmoe-1b-7b", 6.9e9, 1.3e9),
        ("mula-7b-a1b", 6.9e9, 1.3e9),
        ("mula-20b-a2b", 20.1e9, 2.35e9),
        ("mula-100b-a7b", 99.9e9, 7.6e9),
        ("mula-220b-a10b", 220e9, 10.0e9),
        ("mula-1b", 1.2e9, 1.2e9),
    ],
)
def test_preset_sizes_match_their_names_on_meta(preset, total, active):
    config = PRESETS[preset]
    model = build_model(config, device="meta")
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    count = count_parameters(model, config)
    assert count.total == pytest.approx(total, rel=0.07)
    assert count.active == pytest.approx(active, rel=0.07)
    assert flops_per_token(count, config, 4096) > 6 * (count.active - count.embedding)


@pytest.mark.parametrize("config", [TINY_MOE, TINY_DENSE], ids=["moe", "dense"])
def test_loss_equals_cross_entropy_of_logits(config):
    model = build_model(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 17))
    logits = model(ids[:, :-1]).logits
    out = model(ids[:, :-1], ids[:, 1:])
    ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(out.ce_loss, ce, rtol=1e-5, atol=1e-6)
    expected = ce if not config.is_moe else ce + config.aux_loss_coef * out.aux_loss + config.z_loss_coef * out.z_loss
    torch.testing.assert_close(out.loss, expected)
    if config.is_moe:
        assert out.expert_counts.shape == (config.n_layers, config.n_experts)
        assert int(out.expert_counts.sum()) == config.n_layers * ids[:, :-1].numel() * config.top_k


def test_the_loss_backpropagates_every_term():
    """`loss` is what training differentiates: its gradient is the sum of its terms' (the load-balancing and z-loss
    terms' gradients included, not only their values)."""
    model = build_model(TINY_MOE, seed=0)
    ids = torch.randint(0, TINY_MOE.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    router = model.layers["0"].mlp.router.weight

    def router_gradient(term) -> torch.Tensor:
        # a fresh forward for each: the fused loss and expert ops' backwards run once per forward (reused buffers)
        return torch.autograd.grad(term(model(ids[:, :-1], ids[:, 1:])), router)[0]

    got = router_gradient(lambda out: out.loss)
    ce = router_gradient(lambda out: out.ce_loss)
    balance = router_gradient(lambda out: TINY_MOE.aux_loss_coef * out.aux_loss + TINY_MOE.z_loss_coef * out.z_loss)
    assert balance.abs().max() > 1e-3 * ce.abs().max()  # the router terms move the router measurably
    torch.testing.assert_close(got, ce + balance)


@pytest.mark.parametrize("config", [TINY_MOE, TINY_DENSE], ids=["moe", "dense"])
def test_flops_per_token_counted_by_hand(config):
    """6 x each parameter a token uses (a top_k / n_experts share of the experts'; not the embedding lookup's) + the
    attention scores and their weighted sum, 12 L d S (PaLM's count), from the built model's tensors."""
    model = build_model(config, device="meta")
    used = 0.0
    for name, param in model.named_parameters():
        if name.startswith("embed."):
            continue
        used += param.numel() * (config.top_k / config.n_experts if ".experts." in name else 1)
    expected = 6 * used + 12 * config.n_layers * config.d_model * 256
    assert flops_per_token(count_parameters(model, config), config, 256) == pytest.approx(expected, rel=1e-9)


def test_same_seed_same_weights_and_causality():
    a, b = build_model(TINY_MOE, seed=3), build_model(TINY_MOE, seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    ids = torch.randint(0, 512, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 512
    torch.testing.assert_close(a(ids).logits[:, :8], a(changed).logits[:, :8])


def _naive_moe(moe, x):
    """Token-by-token OLMoE semantics: softmax in fp32, top-k, weighted sum of expert SwiGLUs."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(tokens @ moe.router.weight.t(), dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(moe.router.top_k, dim=-1)
    out = torch.zeros_like(tokens)
    w1, w2 = moe.experts.w_gate_up, moe.experts.w_down
    hidden = w2.shape[1]
    for t in range(tokens.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            h = tokens[t] @ w1[e]
            out[t] += weights[t, k] * ((F.silu(h[:hidden]) * h[hidden:]) @ w2[e])
    return out.view_as(x), probs, ids


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_moe_layer_matches_token_by_token_semantics(impl):
    config = TINY_MOE.model_copy(update={"moe_impl": impl})
    moe = build_model(config, seed=1).layers["0"].mlp
    x = torch.randn(2, 5, 64)
    out, stats = moe(x)
    expected, probs, ids = _naive_moe(moe, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    counts = torch.bincount(ids.flatten(), minlength=8).float()
    aux = 8 * (counts / probs.shape[0] * probs.mean(0)).sum()
    torch.testing.assert_close(stats.aux_loss, aux)


def test_reference_and_fast_experts_give_same_gradients():
    grads = []
    for impl in ("auto", "reference"):
        model = build_model(TINY_MOE.model_copy(update={"moe_impl": impl}), seed=2)
        ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
        model(ids[:, :-1], ids[:, 1:]).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_router_terms_are_means_over_the_layers_and_counts_are_per_layer_in_order():
    """The model's aux and z-loss are each the mean of the layers' own (a layer's z-loss: the mean squared log-sum-exp
    of its router logits; its aux: E * sum_e f_e * P_e), and expert_counts row l is layer l's routing, read here from
    each router's own outputs."""
    config = TINY_MOE.model_copy(update={"n_layers": 3})
    model = build_model(config, seed=4)
    routed = []
    for block in model.layers.values():
        block.mlp.router.register_forward_hook(lambda module, args, out: routed.append(out))
    ids = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids[:, :-1], ids[:, 1:])
    assert len(routed) == config.n_layers
    z, aux, counts = [], [], []
    for logits, probs, _, top in routed:
        z.append(logits.double().exp().sum(dim=1).log().pow(2).mean())
        count = torch.bincount(top.flatten(), minlength=config.n_experts)
        aux.append(config.n_experts * (count.double() / top.shape[0] * probs.double().mean(dim=0)).sum())
        counts.append(count)
    # fp32 against float64 sums: a relative 1e-5 is ~100 ulps of headroom
    torch.testing.assert_close(out.z_loss.double(), torch.stack(z).mean(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.aux_loss.double(), torch.stack(aux).mean(), rtol=1e-5, atol=0)
    assert torch.equal(out.expert_counts, torch.stack(counts))
    assert not torch.equal(counts[0], counts[-1])  # the layers route differently, so their order shows
