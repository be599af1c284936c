"""build_optimizer's AdamW kernel: fused wherever torch has the kernel for the parameters' device."""

from __future__ import annotations

import torch

from optimus.optim.build import adamw_kernel, fused_adamw_runs_on


def test_adamw_is_fused_on_every_device_torch_fuses_it_on_and_foreach_elsewhere():
    # xpu is Aurora's: a hard-coded ("cpu", "cuda") once left it on the slower foreach kernel
    assert all(fused_adamw_runs_on(kind) for kind in ("cpu", "cuda", "xpu"))
    assert not fused_adamw_runs_on("meta")
    assert adamw_kernel([{"params": [torch.nn.Parameter(torch.zeros(2))]}]) == {"fused": True}
    assert adamw_kernel([{"params": [torch.nn.Parameter(torch.zeros(2, device="meta"))]}]) == {"foreach": True}


def test_matrices_decay_and_norms_biases_and_embeddings_do_not():
    """OLMo's choice, on the tiny dense and MoE models: every trainable parameter in exactly one group."""
    from optimus.models.transformer import build_model
    from optimus.optim.build import param_groups
    from tests.helpers.parity import tiny_config

    for moe in (False, True):
        model = build_model(tiny_config(moe=moe).model, device=torch.device("cpu"), seed=0)
        names = {id(param): name for name, param in model.named_parameters()}
        decay_of = {}
        for group in param_groups(model, 0.1):
            for param in group["params"]:
                assert names[id(param)] not in decay_of, names[id(param)]
                decay_of[names[id(param)]] = group["weight_decay"]
        assert set(decay_of) == set(names.values())
        kept = {name for name, decay in decay_of.items() if decay == 0.0}
        # the tiny models have no biases: the embedding and every norm's weight (QK-norms included) are kept
        assert kept == {name for name in names.values() if name == "embed.weight" or name.endswith("norm.weight")}
        assert "norm.weight" in kept and any("q_norm" in name for name in kept)
        assert all(decay_of[name] == 0.1 for name in decay_of if name not in kept)
        assert any("experts" in name for name in decay_of if name not in kept) == moe
        assert any(name.endswith("lm_head.weight") for name in decay_of if name not in kept)
