"""models/config.py: the shape rules a ModelConfig enforces, each at its boundary."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from optimus.models.config import ModelConfig

BASE = dict(d_model=64, n_layers=1, n_heads=4, vocab_size=128, n_experts=4, top_k=2, expert_ffn_hidden=16)


def test_top_k_may_be_every_expert_but_not_more():
    assert ModelConfig(**{**BASE, "top_k": 4}).top_k == 4
    with pytest.raises(ValidationError, match=r"top_k \(5\) cannot exceed n_experts \(4\)"):
        ModelConfig(**{**BASE, "top_k": 5})


def test_query_heads_must_split_evenly_over_the_kv_heads():
    """Grouped-query attention shares each kv head among n_heads / n_kv_heads query heads: a whole number."""
    assert ModelConfig(**{**BASE, "n_kv_heads": 2}).kv_heads == 2
    with pytest.raises(ValidationError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        ModelConfig(**{**BASE, "n_kv_heads": 3})


def test_heads_must_split_d_model_into_even_head_dims():
    with pytest.raises(ValidationError, match=r"d_model \(64\) must be divisible by n_heads \(3\)"):
        ModelConfig(**{**BASE, "n_heads": 3})
    with pytest.raises(ValidationError, match="must be even for rotary"):  # 36 / 4 = 9: RoPE rotates pairs
        ModelConfig(**{**BASE, "d_model": 36})
