"""train/step.py by hand: the gradient norm and its clipping, and gradient accumulation as one pass over the batch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from optimus.models.config import ModelConfig
from optimus.models.transformer import build_model
from optimus.optim.build import build_optimizer
from optimus.optim.config import OptimConfig
from optimus.train.step import clip_gradients, forward_backward, train_step

CPU = torch.device("cpu")
DENSE = ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=64, n_experts=0, ffn_hidden=64)


def _params_with_grads() -> list[nn.Parameter]:
    """Two parameters whose gradients have the global L2 norm sqrt(3^2 + 4^2 + 12^2) = 13."""
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    return [a, b]


def test_the_norm_is_the_global_l2_norm_and_clipping_scales_to_the_threshold():
    params = _params_with_grads()
    assert clip_gradients(params, 6.5) == pytest.approx(13.0)  # the norm before clipping
    # every gradient scaled by 6.5 / 13 (torch adds 1e-6 to the norm it divides by: 1e-6 relative)
    torch.testing.assert_close(params[0].grad, torch.tensor([1.5, 2.0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(params[1].grad, torch.tensor([6.0]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("threshold", [0.0, 100.0])
def test_a_zero_or_unreached_threshold_leaves_the_gradients_alone(threshold):
    """optim.grad_clip = 0 means no clipping (not a clip to zero); a norm below the threshold is not scaled up."""
    params = _params_with_grads()
    assert clip_gradients(params, threshold) == pytest.approx(13.0)
    assert torch.equal(params[0].grad, torch.tensor([3.0, 4.0])) and torch.equal(params[1].grad, torch.tensor([12.0]))


def _batch(seed: int = 0, rows: int = 4, seq: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, DENSE.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def test_accumulating_micro_batches_computes_one_pass_over_the_whole_batch():
    """Two micro-batches of 2 sequences: the losses and gradients of one pass over the 4 (equal micro-batches, so
    the mean of their mean losses is the batch's mean loss)."""
    inputs, labels = _batch()
    whole, split = build_model(DENSE, seed=0), build_model(DENSE, seed=0)
    want = forward_backward(whole, [(inputs, labels)], CPU, "fp32")
    got = forward_backward(split, [(inputs[:2], labels[:2]), (inputs[2:], labels[2:])], CPU, "fp32")
    assert set(got) == set(want) == {"loss", "ce_loss"}
    for key in want:  # fp32 sums in another order: a relative 1e-5
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=0)
    for (name, a), b in zip(whole.named_parameters(), split.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_step_reports_every_micro_batchs_tokens_and_the_batch_loss():
    inputs, labels = _batch(seed=1)
    model = build_model(DENSE, seed=0)
    with torch.no_grad():
        want = model(inputs, labels).loss.item()
    optimizer = build_optimizer(model, OptimConfig())
    result = train_step(model, optimizer, [(inputs[:2], labels[:2]), (inputs[2:], labels[2:])], device=CPU,
                        grad_clip=1.0)
    assert result.tokens == inputs.numel() == 4 * 8
    assert result.loss == pytest.approx(want, rel=1e-5) and math.isfinite(result.grad_norm) and not result.skipped
