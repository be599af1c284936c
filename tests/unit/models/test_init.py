"""Seeded initial weights (models/init.py): any slice drawn alone equals that slice of the whole."""

from __future__ import annotations

import math

import pytest
import torch

from optimus.models.init import initial_rows, initial_slice, rows_per_block
from optimus.models.presets import get_preset
from optimus.models.transformer import build_model


@pytest.mark.parametrize("shape", [(4099, 300), (10, 512, 1024), (7, 3, 5), (2_500_000,)])
def test_any_slice_equals_that_slice_of_the_whole(shape):
    whole = initial_rows(7, "layers.0.w", shape, 0.02, 0, shape[0])
    assert rows_per_block(shape) < shape[0] or shape == (7, 3, 5)  # the slices below cross blocks
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        offset = tuple(int(torch.randint(0, n, (), generator=gen)) for n in shape)
        size = tuple(int(torch.randint(0, n - o + 1, (), generator=gen)) for n, o in zip(shape, offset))
        part = initial_slice(7, "layers.0.w", shape, 0.02, offset, size)
        want = whole[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        assert torch.equal(part, want)


def test_values_depend_on_seed_and_name_and_follow_std():
    a = initial_rows(1, "embed.weight", (512, 256), 0.02, 0, 512)
    assert torch.equal(a, initial_rows(1, "embed.weight", (512, 256), 0.02, 0, 512))
    assert not torch.equal(a, initial_rows(2, "embed.weight", (512, 256), 0.02, 0, 512))
    assert not torch.equal(a, initial_rows(1, "lm_head.weight", (512, 256), 0.02, 0, 512))
    assert a.std().item() == pytest.approx(0.02, rel=0.02) and abs(a.mean().item()) < 1e-3
    assert torch.equal(initial_rows(1, "norm.weight", (64,), None, 0, 64), torch.ones(64))


def test_build_model_is_seeded_and_unseeded_follows_the_global_generator():
    config = get_preset("mula-tiny-moe").model_copy(update={"n_layers": 1, "vocab_size": 512})
    a, b, c = (build_model(config, seed=s).state_dict() for s in (3, 3, 4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.mlp.experts.w_gate_up"],
                           c["layers.0.mlp.experts.w_gate_up"])
    torch.manual_seed(11)
    d = build_model(config).state_dict()
    torch.manual_seed(11)
    e = build_model(config).state_dict()
    assert all(torch.equal(d[k], e[k]) for k in d)
    torch.manual_seed(12)  # another global seed, other weights: the seed drawn is not a constant
    assert not torch.equal(build_model(config).state_dict()["embed.weight"], d["embed.weight"])
    # output projections are scaled down with depth; norms start at one
    model = build_model(config, seed=0)
    assert model.initial_std("layers.0.attn.o_proj.weight") < model.initial_std("layers.0.attn.q_proj.weight")
    assert torch.equal(model.layers["0"].attn_norm.weight, torch.ones(config.d_model))


@pytest.mark.parametrize("preset", ["mula-tiny-moe", "mula-tiny-dense"])
@pytest.mark.parametrize("n_layers", [2, 8])
def test_output_projections_start_at_init_std_over_the_root_of_twice_the_depth(n_layers, preset):
    """GPT-2's residual scaling, as a built model's weights show it: every block's attention output projection and
    its MLP's (the experts' w_down, a dense block's down_proj) drawn at init_std / sqrt(2 L), its other matrices at
    init_std, its norms at one."""
    config = get_preset(preset).model_copy(update={"n_layers": n_layers, "vocab_size": 512})
    model = build_model(config, seed=0)
    scaled = config.init_std / math.sqrt(2 * n_layers)
    for name, param in model.named_parameters():
        want = (None if name.endswith("norm.weight")
                else scaled if name.endswith(("o_proj.weight", "w_down", "down_proj.weight")) else config.init_std)
        if want is None:
            assert model.initial_std(name) is None and torch.equal(param, torch.ones_like(param)), name
            continue
        assert model.initial_std(name) == pytest.approx(want), name
        if param.numel() >= 4096:  # the drawn values follow it (within 5% at 4k+ samples)
            assert param.std().item() == pytest.approx(want, rel=0.05), name
