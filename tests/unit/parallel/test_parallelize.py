"""parallelize_model in one process: activation checkpointing (full, selective) changes memory, not
results or checkpoint keys; the gradient norm and clipping handle plain tensors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from optimus.models.transformer import build_model
from optimus.parallel.mesh import ParallelDims
from optimus.parallel.parallelize import parallelize_model
from optimus.testing.parity import global_batches, rank_micro_batches, tiny_config
from optimus.train.step import clip_gradients, forward_backward


def _grads(config) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    model = build_model(config.model, seed=0)
    model = parallelize_model(model, ParallelDims(world_size=1), None, config)
    batch = rank_micro_batches(global_batches(config, 1)[0], config.train.micro_batch_size)
    forward_backward(model, batch, torch.device("cpu"), "fp32")
    names = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return names, model


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_gradients_and_checkpoint_keys(moe, mode):
    want, plain = _grads(tiny_config(moe=moe))
    got, wrapped = _grads(tiny_config(moe=moe, train=dict(activation_checkpointing=mode)))
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    # DCP sees the single-process names: a checkpoint moves between runs with and without it
    assert set(get_model_state_dict(wrapped)) == set(get_model_state_dict(plain))


def test_clip_gradients_plain_tensors_matches_torch():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    norm = clip_gradients(params, max_norm=1.0)
    assert norm == pytest.approx((7 * 4.0) ** 0.5)
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
    assert total.item() == pytest.approx(1.0, rel=1e-5)
