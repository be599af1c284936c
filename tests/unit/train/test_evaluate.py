"""train/evaluate.py: the summary figures of a held-out loss by hand, and the model's mode around an evaluation."""

from __future__ import annotations

import math

import pytest
import torch

from optimus.models.config import ModelConfig
from optimus.models.transformer import build_model
from optimus.train.evaluate import EvalResult, evaluate


def test_bits_per_byte_is_the_total_nats_in_bits_over_the_bytes():
    # 1,000 tokens at 2 nats each decode to 4,000 bytes: 2,000 nats = 2,885.4 bits over 4,000 bytes
    result = EvalResult(loss=2.0, tokens=1000, bytes=4000)
    assert result.bits_per_byte == pytest.approx(2000 / math.log(2) / 4000)
    assert result.perplexity == pytest.approx(math.exp(2.0))
    assert EvalResult(loss=2.0, tokens=1000).bits_per_byte is None  # the bytes are not known


@pytest.mark.parametrize("training", [False, True])
def test_evaluation_puts_the_model_back_in_the_mode_it_found(training):
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, vocab_size=32, n_experts=0, ffn_hidden=32),
                        seed=0).train(training)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    result = evaluate(model, [(tokens[:, :-1], tokens[:, 1:])], torch.device("cpu"))
    assert result.tokens == 16 and model.training is training
