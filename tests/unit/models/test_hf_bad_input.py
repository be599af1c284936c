"""Hugging Face folders `optimus import` must refuse in one line, not import into a silently wrong model: NaN/inf
weights, a tensor stored in two files, a head the config does not tie, non-integer sizes in config.json, and a
max_position_embeddings that is no context length. Built from our own export (no transformers needed)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from optimus.models.config import ModelConfig
from optimus.models.hf import InteropError, context_length_from_hf, export_hf, import_hf, read_hf_config
from optimus.models.transformer import build_model
from tests.helpers.hf import edit_hf_config, hf_import_error

CONFIG = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=128, n_experts=0, ffn_hidden=96, qk_norm=False)


def _exported(tmp_path):
    return export_hf(build_model(CONFIG, seed=0), CONFIG, tmp_path / "hf", dense_format="llama")


def _edit_weights(path, **changes):
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update(changes)
    tensors = {k: v for k, v in tensors.items() if v is not None}  # None drops the tensor
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_our_export_imports_untied_with_its_own_head(tmp_path):
    path = _exported(tmp_path)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False
    stored = load_file(str(path / "model.safetensors"))
    _, state = import_hf(path)
    assert torch.equal(state["lm_head.weight"], stored["lm_head.weight"])
    assert not torch.equal(state["lm_head.weight"], state["embed.weight"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, bad):
    path = _exported(tmp_path)
    q = load_file(str(path / "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"]
    q[3, 5] = bad
    _edit_weights(path, **{"model.layers.1.self_attn.q_proj.weight": q})
    assert hf_import_error(path).startswith("tensor 'model.layers.1.self_attn.q_proj.weight' holds NaN or inf values")


def test_a_tensor_in_two_unindexed_files_is_refused_naming_both(tmp_path):
    path = _exported(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    first = {k: v for k, v in tensors.items() if not k.startswith("model.layers.1.")}
    second = {k: v for k, v in tensors.items() if k.startswith("model.layers.1.")}
    second["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])  # a stale copy
    save_file(first, str(path / "a.safetensors"))
    save_file(second, str(path / "b.safetensors"))
    message = hf_import_error(path)
    assert message.startswith("tensor 'model.norm.weight' is in both 'a.safetensors' and 'b.safetensors'")
    del second["model.norm.weight"]  # each tensor once: the two files import
    save_file(second, str(path / "b.safetensors"))
    _, state = import_hf(path)
    assert torch.equal(state["norm.weight"], tensors["model.norm.weight"])


@pytest.mark.parametrize("tie", [False, ...])  # ...: the key absent (Olmoe/Olmo2/LlamaConfig default it to false)
def test_a_missing_head_is_refused_unless_config_ties_it(tmp_path, tie):
    path = _exported(tmp_path)
    _edit_weights(path, **{"lm_head.weight": None})
    edit_hf_config(path, tie_word_embeddings=tie)
    assert hf_import_error(path).startswith("the weights have no lm_head.weight and config.json does not set "
                                          "tie_word_embeddings: true")
    edit_hf_config(path, tie_word_embeddings=True)
    _, state = import_hf(path)
    assert torch.equal(state["lm_head.weight"], state["embed.weight"])


def test_a_tied_config_uses_the_embedding_as_head_as_transformers_does(tmp_path):
    # transformers ties the head to the embedding when the config says so, whatever lm_head the files hold
    path = _exported(tmp_path)
    edit_hf_config(path, tie_word_embeddings=True)
    stored = load_file(str(path / "model.safetensors"))
    _, state = import_hf(path)
    assert torch.equal(state["lm_head.weight"], stored["model.embed_tokens.weight"])
    assert not torch.equal(state["lm_head.weight"], stored["lm_head.weight"])


@pytest.mark.parametrize("field, value, shown", [
    ("hidden_size", True, "true"), ("hidden_size", 64.0, "64.0"), ("hidden_size", "64", '"64"'),
    ("num_hidden_layers", False, "false"), ("vocab_size", 128.5, "128.5"), ("num_key_value_heads", True, "true"),
    ("intermediate_size", None, "null"),
])
def test_integer_fields_take_only_integers(tmp_path, field, value, shown):
    path = _exported(tmp_path)
    edit_hf_config(path, **{field: value})
    assert hf_import_error(path) == (f"config.json field {field} must be a whole number (got {shown}): is it an HF "
                                   "config.json?")


def test_null_optional_integer_fields_are_derived(tmp_path):
    path = _exported(tmp_path)
    edit_hf_config(path, num_key_value_heads=None, head_dim=None)
    config, _ = import_hf(path)
    assert config.kv_heads == CONFIG.n_heads and config.d_model == CONFIG.d_model


def test_the_context_length_is_the_exported_one_and_absent_or_null_is_none(tmp_path):
    path = export_hf(build_model(CONFIG, seed=0), CONFIG, tmp_path / "hf", dense_format="llama", context_length=512)
    assert context_length_from_hf(read_hf_config(path)) == 512
    assert context_length_from_hf({}) is None and context_length_from_hf({"max_position_embeddings": None}) is None


@pytest.mark.parametrize("value, shown", [("4096", '"4096"'), (4096.0, "4096.0"), (True, "true"), (0, "0"),
                                          (-8, "-8"), ([4096], "[4096]")])
def test_a_max_position_embeddings_that_is_no_context_length_is_refused(value, shown):
    with pytest.raises(InteropError) as err:
        context_length_from_hf({"max_position_embeddings": value})
    assert str(err.value) == (f"config.json field max_position_embeddings must be a positive whole number (got "
                              f"{shown}): set it to the context the model was trained at, or delete it and pass "
                              "--train.seq_len=N to optimus train")


def _hf(family: str, **extra) -> dict:
    """The fewest fields config_from_hf needs for `family`: every optional one left to its default."""
    hf = {"model_type": family, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 128, "intermediate_size": 32}
    return hf | ({"num_experts": 4, "num_experts_per_tok": 2} if family == "olmoe" else {}) | extra


def test_a_config_json_without_its_optional_fields_gets_the_transformers_defaults():
    """OLMoE: no top-k renormalisation, router aux loss 0.01; every family: RoPE theta 10,000, RMSNorm eps 1e-5, init
    std 0.02. A dense model has no router, so neither router loss."""
    from optimus.models.hf import config_from_hf

    moe = config_from_hf(_hf("olmoe"))
    assert (moe.norm_topk_prob, moe.aux_loss_coef, moe.rope_theta, moe.norm_eps, moe.init_std) == (
        False, 0.01, 10000.0, 1e-5, 0.02)
    assert (moe.qk_norm, moe.norm_placement, moe.n_experts, moe.top_k, moe.expert_ffn_hidden) == (True, "pre", 4, 2, 32)
    for family, qk_norm, placement in (("olmo2", True, "post"), ("llama", False, "pre")):
        dense = config_from_hf(_hf(family))
        assert (dense.qk_norm, dense.norm_placement, dense.n_experts, dense.ffn_hidden) == (qk_norm, placement, 0, 32)
        assert (dense.aux_loss_coef, dense.z_loss_coef, dense.rope_theta, dense.norm_eps) == (0.0, 0.0, 10000.0, 1e-5)


def test_rope_theta_is_read_from_rope_parameters_or_the_older_rope_scaling():
    from optimus.models.hf import config_from_hf

    for key in ("rope_parameters", "rope_scaling"):
        hf = _hf("llama", **{key: {"rope_type": "default", "rope_theta": 500000.0}}, rope_theta=1.0)
        assert config_from_hf(hf).rope_theta == 500000.0


def test_swish_is_silu_and_another_activation_is_refused():
    from optimus.models.hf import config_from_hf

    assert config_from_hf(_hf("llama", hidden_act="swish")).n_experts == 0
    with pytest.raises(InteropError, match="uses hidden_act, which Optimus's decoder lacks"):
        config_from_hf(_hf("llama", hidden_act="gelu"))


def test_an_moe_without_qk_norm_has_no_hf_layout():
    from optimus.models.hf import pick_format

    config = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=128, n_experts=4, top_k=2,
                         expert_ffn_hidden=32, qk_norm=False)
    with pytest.raises(InteropError, match="HF OLMoE needs norm_placement 'pre' and qk_norm true"):
        pick_format(config)


def test_a_tied_config_without_an_embedding_names_the_missing_tensor(tmp_path):
    path = _exported(tmp_path)
    edit_hf_config(path, tie_word_embeddings=True)
    _edit_weights(path, **{"model.embed_tokens.weight": None})
    assert hf_import_error(path) == ("tensor 'model.embed_tokens.weight' is missing from the safetensors files: is the "
                                     "checkpoint complete?")


def test_one_unexpected_tensor_is_named_alone_and_old_rope_buffers_are_ignored(tmp_path):
    path = _exported(tmp_path)
    _edit_weights(path, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    import_hf(path)
    _edit_weights(path, **{"extra.weight": torch.ones(2)})
    assert hf_import_error(path) == ("unexpected tensor 'extra.weight' for a llama model of this config: is "
                                     "config.json from the same checkpoint?")


def test_fused_experts_that_are_not_3_d_are_refused_in_one_line():
    from optimus.models.hf import _take_experts

    config = ModelConfig(d_model=8, n_layers=1, n_heads=2, vocab_size=16, n_experts=2, top_k=1, expert_ffn_hidden=4)
    prefix = "model.layers.0.mlp.experts."
    for gate_up, down in ((torch.zeros(2, 8, 8), torch.zeros(8, 4)), (torch.zeros(16, 8), torch.zeros(2, 8, 4))):
        with pytest.raises(InteropError, match="fused experts of layer 0 are not 3-d tensors"):
            _take_experts({prefix + "gate_up_proj": gate_up, prefix + "down_proj": down}, 0, config)


def test_an_export_over_an_earlier_one_leaves_none_of_its_shards_or_index(tmp_path):
    path = _exported(tmp_path)
    for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (path / stale).write_text("{}")
    export_hf(build_model(CONFIG, seed=1), CONFIG, path, dense_format="llama", overwrite=True)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    import_hf(path)
