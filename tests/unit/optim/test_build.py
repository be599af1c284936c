"""build_optimizer: its parameter groups (what decays, in a fixed order), the learning rate in each, and its
AdamW kernel (fused wherever torch has the kernel for the parameters' device)."""

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


def test_a_wrapped_models_embeddings_do_not_decay_and_the_decay_group_comes_first():
    """A wrapper (torch.compile's `_orig_mod.`, a pipeline stage's module) prefixes every name: its embedding is still
    an embedding. And the group order is fixed, decay first, whatever order the parameters come in: a checkpoint's
    optimizer state is matched to the groups by position."""
    from optimus.optim.build import param_groups

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)  # registered first: the no-decay group meets its parameter first
            self.proj = torch.nn.Linear(4, 4, bias=False)

    model = torch.nn.Module()
    model.inner = Wrapper()
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["params"] == [model.inner.proj.weight] and groups[1]["params"] == [model.inner.embed.weight]


def test_the_learning_rate_reaches_every_group():
    from optimus.optim.build import set_lr

    optimizer = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                                   {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0}])
    set_lr(optimizer, 0.25)
    assert [g["lr"] for g in optimizer.param_groups] == [0.25, 0.25]


def test_a_mix_of_devices_with_one_torch_does_not_fuse_gets_foreach():
    """fused=True needs the kernel on every parameter's device: one it lacks (meta here) and AdamW would refuse it."""
    mixed = [{"params": [torch.nn.Parameter(torch.zeros(2))]},
             {"params": [torch.nn.Parameter(torch.zeros(2, device="meta"))]}]
    assert adamw_kernel(mixed) == {"foreach": True}


def test_biases_do_not_decay_and_frozen_parameters_are_left_out():
    """A 1-D parameter (a bias) is kept from decay like a norm's weight; one that does not train is in no group."""
    from optimus.optim.build import param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight.requires_grad_(False)
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["params"] == [model[0].weight] and groups[1]["params"] == [model[0].bias, model[1].bias]


def test_within_a_decay_setting_plain_parameters_come_before_dtensor_ones(monkeypatch):
    """The group order is fixed (a checkpoint's optimizer state is matched by position): decay first, and in each the
    plain parameters' group before the DTensor one, whatever order the model registers them in. A Parameter subclass
    stands in for DTensor (a real one needs a process group)."""
    import optimus.optim.build as build

    class Sharded(torch.nn.Parameter):
        pass

    monkeypatch.setattr(build, "DTensor", Sharded)
    model = torch.nn.Module()
    model.router = Sharded(torch.zeros(4, 4))
    model.proj = torch.nn.Parameter(torch.zeros(4, 4))
    model.norm = Sharded(torch.zeros(4))
    model.bias = torch.nn.Parameter(torch.zeros(4))
    groups = build.param_groups(model, 0.1)
    assert [(g["weight_decay"], [p is model.router or p is model.norm for p in g["params"]]) for g in groups] == [
        (0.1, [False]), (0.1, [True]), (0.0, [False]), (0.0, [True])]
