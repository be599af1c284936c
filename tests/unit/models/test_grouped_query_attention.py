"""models/attention.py: grouped-query attention is multi-head attention whose query heads share key/value heads in
order (heads 0 and 1 the first kv head, 2 and 3 the second, as HF's repeat_kv does), and it is causal."""

from __future__ import annotations

import torch

from optimus.models.attention import Attention
from optimus.models.config import ModelConfig
from optimus.models.layers import rotary_cos_sin


def _config(kv_heads: int, qk_norm: bool = True) -> ModelConfig:
    return ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=kv_heads, vocab_size=64, n_experts=0,
                       ffn_hidden=64, qk_norm=qk_norm)


def _inputs(seq: int = 6):
    torch.manual_seed(0)
    cos, sin = rotary_cos_sin(seq, 8, 10000.0, torch.device("cpu"), torch.float32)
    return torch.randn(2, seq, 32), cos, sin


def test_grouped_query_attention_is_multi_head_attention_with_each_kv_head_repeated_in_order():
    """Two kv heads for four query heads equal four kv heads whose k/v projections (and k-norm weights) repeat each
    kv head's rows for the two query heads after it."""
    torch.manual_seed(1)
    gqa, mha = Attention(_config(2)), Attention(_config(4))
    with torch.no_grad():
        gqa.k_norm.weight.uniform_(0.5, 1.5)
        for name in ("q_proj", "o_proj", "q_norm"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):  # rows [kv head 0, kv head 1] -> [0, 0, 1, 1], 8 rows a head
            rows = getattr(gqa, name).weight.view(2, 8, 32)
            getattr(mha, name).weight.copy_(rows.repeat_interleave(2, dim=0).reshape(32, 32))
        mha.k_norm.weight.copy_(gqa.k_norm.weight.view(2, 8).repeat_interleave(2, dim=0).reshape(32))
    x, cos, sin = _inputs()
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin))
    with torch.no_grad():  # shared the other way round ([0, 1, 0, 1]), the heads meet other keys: not equal
        for name in ("k_proj", "v_proj"):
            rows = getattr(gqa, name).weight.view(2, 8, 32)
            getattr(mha, name).weight.copy_(rows.repeat(2, 1, 1).reshape(32, 32))
        mha.k_norm.weight.copy_(gqa.k_norm.weight.view(2, 8).repeat(2, 1).reshape(32))
    assert not torch.allclose(gqa(x, cos, sin), mha(x, cos, sin))


def test_attention_never_looks_ahead():
    """Changing the later tokens leaves every earlier position's output as it was; the changed ones move."""
    attention = Attention(_config(2))
    x, cos, sin = _inputs()
    later = x.clone()
    later[:, 4:] = torch.randn(2, 2, 32)
    before, after = attention(x, cos, sin), attention(later, cos, sin)
    torch.testing.assert_close(after[:, :4], before[:, :4])
    assert not torch.allclose(after[:, 4:], before[:, 4:])
