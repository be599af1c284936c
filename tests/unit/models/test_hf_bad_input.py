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
