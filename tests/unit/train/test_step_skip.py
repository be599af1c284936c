"""train_step's skip decision: a rejected or non-finite step changes nothing and says why; others step."""

from __future__ import annotations

import copy

import torch

from optimus.models.transformer import build_model
from optimus.optim.build import build_optimizer
from tests.helpers.parity import tiny_config
from optimus.train.step import train_step

CPU = torch.device("cpu")


def micro_batches(seed: int, config):
    g = torch.Generator().manual_seed(seed)
    t = config.train
    tokens = torch.randint(0, config.model.vocab_size, (t.global_batch_size, t.seq_len + 1), generator=g)
    return [(tokens[i:i + t.micro_batch_size, :-1], tokens[i:i + t.micro_batch_size, 1:])
            for i in range(0, t.global_batch_size, t.micro_batch_size)]


def model_and_optimizer(config):
    model = build_model(config.model, device=CPU, seed=config.train.seed)
    return model, build_optimizer(model, config.optim)


def step(model, optimizer, batch, config, skip_step=None):
    return train_step(model, optimizer, batch, device=CPU, grad_clip=config.optim.grad_clip, skip_step=skip_step)


def assert_nothing_changed(model, optimizer, weights: dict, moments: dict) -> None:
    """The weights and AdamW's moments are the ones saved before the step, and no gradient is held."""
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    after = optimizer.state_dict()
    for pid, state in moments["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)
    assert all(p.grad is None for p in model.parameters())


def test_a_rejected_step_leaves_weights_and_optimizer_state_unchanged():
    config = tiny_config(moe=True)
    model, optimizer = model_and_optimizer(config)
    step(model, optimizer, micro_batches(0, config), config)  # some optimizer state to keep
    weights = copy.deepcopy(model.state_dict())
    moments = copy.deepcopy(optimizer.state_dict())
    seen = []
    result = step(model, optimizer, micro_batches(1, config), config, skip_step=lambda loss: seen.append(loss) or True)
    assert result.skipped and result.skip_reason == "loss spike"
    assert seen == [result.loss]  # judged on the step's (global) loss
    assert_nothing_changed(model, optimizer, weights, moments)


def test_an_accepted_step_matches_a_step_without_a_predicate():
    config = tiny_config(moe=True)
    plain, plain_opt = model_and_optimizer(config)
    guarded, guarded_opt = model_and_optimizer(config)
    for seed in range(2):
        expected = step(plain, plain_opt, micro_batches(seed, config), config)
        result = step(guarded, guarded_opt, micro_batches(seed, config), config, skip_step=lambda loss: False)
        assert not result.skipped and result.skip_reason is None
        assert (result.loss, result.grad_norm) == (expected.loss, expected.grad_norm)
    for (name, a), b in zip(plain.state_dict().items(), guarded.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_non_finite_loss_is_skipped_without_asking_the_predicate():
    config = tiny_config()
    model, optimizer = model_and_optimizer(config)
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))
    weights = copy.deepcopy(model.state_dict())
    asked = []
    result = step(model, optimizer, micro_batches(0, config), config, skip_step=lambda loss: asked.append(loss))
    assert result.skipped and result.skip_reason == "non-finite"
    assert asked == []
    for name, value in model.state_dict().items():
        assert torch.allclose(value, weights[name], rtol=0, atol=0, equal_nan=True), name


def test_a_finite_loss_with_a_non_finite_gradient_is_skipped_and_the_next_step_trains():
    """What a bf16 backward that overflows gives: the loss is fine, a gradient is not. The step is skipped as
    non-finite (the predicate is not asked), nothing changes, and the next step with finite gradients trains."""
    config = tiny_config()
    model, optimizer = model_and_optimizer(config)
    step(model, optimizer, micro_batches(0, config), config)  # some optimizer state to keep
    weights = copy.deepcopy(model.state_dict())
    moments = copy.deepcopy(optimizer.state_dict())
    overflow = model.norm.weight.register_hook(lambda grad: grad * float("inf"))
    asked = []
    result = step(model, optimizer, micro_batches(1, config), config, skip_step=lambda loss: asked.append(loss))
    overflow.remove()
    assert result.skipped and result.skip_reason == "non-finite" and asked == []
    assert torch.isfinite(torch.tensor(result.loss)) and not torch.isfinite(torch.tensor(result.grad_norm))
    assert_nothing_changed(model, optimizer, weights, moments)
    resumed = step(model, optimizer, micro_batches(1, config), config)
    assert not resumed.skipped and torch.isfinite(torch.tensor(resumed.grad_norm))
    assert not torch.equal(model.norm.weight, weights["norm.weight"])
