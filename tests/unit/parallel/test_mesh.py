"""ParallelDims.check_model: layouts the model or the sequence length cannot take are refused in one line."""

from __future__ import annotations

import pytest

from optimus.models.config import ModelConfig
from optimus.parallel.mesh import LayoutError, ParallelDims

MODEL = ModelConfig(d_model=64, n_layers=4, n_heads=4, vocab_size=256, n_experts=8, top_k=2, expert_ffn_hidden=32)


def test_sequence_length_must_divide_over_tensor_parallel_ranks():
    dims = ParallelDims(tp=2, world_size=2)
    dims.check_model(MODEL, seq_len=64)
    dims.check_model(MODEL)  # no sequence length given: not checked
    with pytest.raises(LayoutError, match=r"train.seq_len \(33\) must be a multiple of parallel.tp \(2\)") as err:
        dims.check_model(MODEL, seq_len=33)
    assert "\n" not in str(err.value)
    ParallelDims(dp_shard=2, world_size=2).check_model(MODEL, seq_len=33)  # no tp: any length


def test_heads_and_experts_must_divide():
    with pytest.raises(LayoutError, match="n_heads"):
        ParallelDims(tp=8, world_size=8).check_model(MODEL)
    with pytest.raises(LayoutError, match="n_experts"):
        ParallelDims(dp_shard=3, ep=3, world_size=3).check_model(MODEL)
