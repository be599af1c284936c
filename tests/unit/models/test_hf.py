"""Hugging Face interop: our models load in transformers with equal logits, and back again."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from optimus.models.config import ModelConfig  # noqa: E402
from optimus.models.generate import generate  # noqa: E402
from optimus.models.hf import (  # noqa: E402
    MAX_POSITIONS, InteropError, config_from_hf, context_length_from_hf, export_hf, hf_config, import_hf,
    read_hf_config,
)
from optimus.models.presets import get_preset  # noqa: E402
from optimus.models.transformer import build_model  # noqa: E402
from tests.helpers.hf import edit_hf_config, hf_import_error  # noqa: E402

TOL = 1e-5
VOCAB = 512
_BASE = dict(d_model=64, n_layers=2, n_heads=4, vocab_size=VOCAB, n_experts=8, top_k=2, expert_ffn_hidden=32,
             ffn_hidden=96)
CONFIGS = {
    "olmoe": ModelConfig(**_BASE),
    "olmoe-normtopk": ModelConfig(**{**_BASE, "norm_topk_prob": True}),
    "olmo2": ModelConfig(**{**_BASE, "n_experts": 0, "norm_placement": "post", "norm_eps": 1e-6,
                            "rope_theta": 500000.0}),
    "llama-gqa": ModelConfig(**{**_BASE, "n_experts": 0, "qk_norm": False, "n_kv_heads": 2}),
}
ARCH = {"olmoe": "OlmoeForCausalLM", "olmoe-normtopk": "OlmoeForCausalLM", "olmo2": "Olmo2ForCausalLM",
        "llama-gqa": "LlamaForCausalLM"}


def _ours(config: ModelConfig, seed: int = 0):
    model = build_model(config, seed=seed)
    # Norm weights start at one, which would hide a swapped or dropped norm: make them distinct.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(0.2 * torch.randn_like(param))
    return model.eval()


def _hf_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=1,
                  eos_token_id=VOCAB - 1)
    if family.startswith("olmoe"):
        return transformers.OlmoeConfig(**common, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                        norm_topk_prob=family == "olmoe-normtopk")
    if family == "olmo2":
        return transformers.Olmo2Config(**common, intermediate_size=96, rms_norm_eps=1e-6,
                                        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return transformers.LlamaConfig(**common, intermediate_size=96, num_key_value_heads=2, bos_token_id=None,
                                    rms_norm_eps=1e-5)


def _hf_random(family: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(family), attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    return model.eval()


def _load_hf(path):
    # sdpa (the default) and eager both agree with ours to ~3e-7 in fp32 on CPU.
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", output_loading_info=True)


def _ids(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------------- ours -> HF
@pytest.mark.parametrize("family", list(CONFIGS))
def test_export_loads_in_transformers_with_equal_logits(family, tmp_path):
    config = CONFIGS[family]
    ours = _ours(config)
    out = export_hf(ours, config, tmp_path / "hf")
    hf, info = _load_hf(out)
    assert type(hf).__name__ == ARCH[family]
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    with torch.no_grad():
        assert _max_diff(ours(_ids()).logits, hf(_ids()).logits) <= TOL


def test_export_weights_are_identical_in_transformers(tmp_path):
    config = CONFIGS["olmoe"]
    ours = _ours(config)
    hf, _ = _load_hf(export_hf(ours, config, tmp_path / "hf"))
    layer, our_layer = hf.model.layers[1], ours.layers["1"]
    assert torch.equal(layer.mlp.gate.weight, our_layer.mlp.router.weight)
    assert torch.equal(layer.mlp.experts.gate_up_proj, our_layer.mlp.experts.w_gate_up.transpose(1, 2))
    assert torch.equal(layer.mlp.experts.down_proj, our_layer.mlp.experts.w_down.transpose(1, 2))
    assert torch.equal(layer.self_attn.k_norm.weight, our_layer.attn.k_norm.weight)
    assert torch.equal(layer.input_layernorm.weight, our_layer.attn_norm.weight)
    assert torch.equal(hf.lm_head.weight, ours.lm_head.weight)
    # Row pad_token_id (1) too: HF's nn.Embedding has padding_idx=1, which must not zero it on load.
    assert torch.equal(hf.model.embed_tokens.weight, ours.embed.weight)


def test_export_writes_hub_layout_and_config(tmp_path):
    config = CONFIGS["olmoe"]
    out = export_hf(_ours(config), config, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # One nn.Linear triple per expert, as on the Hub, so that transformers 4.x loads it too.
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "olmoe" and hf["architectures"] == ["OlmoeForCausalLM"]
    assert (hf["num_experts"], hf["num_experts_per_tok"], hf["intermediate_size"]) == (8, 2, 32)
    assert hf["tie_word_embeddings"] is False and hf["output_router_logits"] is False
    assert (hf["pad_token_id"], hf["eos_token_id"], hf["torch_dtype"]) == (1, 50279, "float32")
    assert hf["rope_theta"] == hf["rope_parameters"]["rope_theta"] == 10000.0
    assert hf["max_position_embeddings"] == MAX_POSITIONS  # no run's seq_len given: OLMoE's 4096


def test_export_states_the_context_length_it_is_given_and_import_reads_it_back(tmp_path):
    config = CONFIGS["llama-gqa"]
    out = export_hf(_ours(config), config, tmp_path / "hf", context_length=1024)
    hf, _ = _load_hf(out)
    assert hf.config.max_position_embeddings == 1024
    assert context_length_from_hf(read_hf_config(out)) == 1024


def test_export_over_an_earlier_export_but_not_over_other_files(tmp_path):
    config = CONFIGS["llama-gqa"]
    out = export_hf(_ours(config), config, tmp_path / "hf")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    with pytest.raises(InteropError, match="already holds a model"):  # nor a downloaded model's folder
        export_hf(_ours(config, seed=1), config, out)
    export_hf(_ours(config, seed=1), config, out, overwrite=True)  # an earlier export may be replaced
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(InteropError, match="not empty"):
        export_hf(_ours(config), config, tmp_path / "other")


@pytest.mark.parametrize(
    "family, dense_format, match",
    [("olmo2", "llama", "--dense-format olmo2"), ("llama-gqa", "olmo2", "--dense-format llama"),
     ("olmoe", "llama", "drop the flag"), ("olmo2", "gpt2", "unknown dense format")],
)
def test_export_refuses_a_dense_format_that_does_not_fit(family, dense_format, match, tmp_path):
    config = CONFIGS[family]
    with pytest.raises(InteropError, match=match) as err:
        export_hf(_ours(config), config, tmp_path / "hf", dense_format=dense_format)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "hf").exists()


def test_export_refuses_a_dense_model_with_no_hf_layout(tmp_path):
    config = CONFIGS["olmo2"].model_copy(update={"qk_norm": False})
    with pytest.raises(InteropError, match="no HF layout"):
        export_hf(_ours(config), config, tmp_path / "hf")


# ---------------------------------------------------------------------------------- HF -> ours
def _import_into_ours(path):
    config, state_dict = import_hf(path)
    model = build_model(config, seed=123)
    model.load_state_dict(state_dict, strict=True)
    return config, model.eval()


@pytest.mark.parametrize("family", list(CONFIGS))
def test_import_from_transformers_gives_equal_logits(family, tmp_path):
    hf = _hf_random(family)
    hf.save_pretrained(tmp_path / "hf")
    config, ours = _import_into_ours(tmp_path / "hf")
    expected = CONFIGS[family]
    assert (config.n_experts, config.qk_norm, config.norm_placement, config.kv_heads, config.vocab_size) == (
        expected.n_experts, expected.qk_norm, expected.norm_placement, expected.kv_heads, VOCAB)
    assert (config.norm_topk_prob, config.rope_theta, config.norm_eps) == (
        expected.norm_topk_prob, expected.rope_theta, expected.norm_eps)
    with torch.no_grad():
        assert _max_diff(ours(_ids()).logits, hf(_ids()).logits) <= TOL


def test_import_reads_fused_experts_and_shards(tmp_path):
    hf = _hf_random("olmoe")
    # transformers 5's in-memory layout (fused gate_up_proj / down_proj) written as is.
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors"))
    hf.config.to_json_file(tmp_path / "fused" / "config.json")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for folder in ("fused", "sharded"):
        _, ours = _import_into_ours(tmp_path / folder)
        with torch.no_grad():
            assert _max_diff(ours(_ids()).logits, hf(_ids()).logits) <= TOL, folder


def test_import_untie_tied_embeddings(tmp_path):
    config = _hf_config("llama-gqa")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    _, ours = _import_into_ours(tmp_path / "hf")
    assert torch.equal(ours.lm_head.weight, ours.embed.weight)
    with torch.no_grad():
        assert _max_diff(ours(_ids()).logits, hf(_ids()).logits) <= TOL


def test_export_import_round_trip_is_exact(tmp_path):
    config = CONFIGS["olmoe-normtopk"]
    ours = _ours(config)
    back_config, state_dict = import_hf(export_hf(ours, config, tmp_path / "hf"))
    assert back_config.model_dump(exclude={"ffn_hidden"}) == config.model_dump(exclude={"ffn_hidden"})
    assert all(torch.equal(state_dict[k], v) for k, v in ours.state_dict().items())


def test_hub_olmoe_config_maps_to_our_preset_and_back():
    # The fields of allenai/OLMoE-1B-7B-0924's config.json (transformers 4.x style: top-level rope_theta).
    hub = {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": False, "clip_qkv": None,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 1024, "num_attention_heads": 16,
        "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16,
        "norm_topk_prob": False, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.01, "tie_word_embeddings": False, "vocab_size": 50304, "pad_token_id": 1,
        "eos_token_id": 50279, "torch_dtype": "bfloat16", "max_position_embeddings": 4096,
    }
    preset = get_preset("olmoe-1b-7b")
    assert config_from_hf(hub).model_dump(exclude={"preset"}) == preset.model_dump(exclude={"preset"})
    assert config_from_hf(hf_config(preset, "olmoe")) == preset.model_copy(update={"preset": None})
    assert context_length_from_hf(hub) == 4096 == context_length_from_hf(hf_config(preset, "olmoe", 4096))


# ------------------------------------------------------------------------------------ generate
@pytest.mark.parametrize("family", ["olmoe", "olmo2", "llama-gqa"])
def test_greedy_generate_matches_transformers(family, tmp_path):
    config = CONFIGS[family]
    ours = _ours(config)
    hf, _ = _load_hf(export_hf(ours, config, tmp_path / "hf"))
    prompt = _ids(batch=1, seq=6)
    # The exported eos (50279) lies outside this tiny vocab, so neither side stops early.
    theirs = hf.generate(prompt, do_sample=False, max_new_tokens=8, pad_token_id=1)[:, prompt.shape[1]:]
    mine = generate(ours, prompt, max_new_tokens=8)
    assert mine.shape == (1, 8)
    assert torch.equal(mine, theirs)


# ---------------------------------------------------------------------------------- error paths
def _saved(tmp_path, family: str = "olmoe"):
    _hf_random(family).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_import_refuses_an_unknown_model_type(tmp_path):
    path = _saved(tmp_path)
    edit_hf_config(path, model_type="mixtral")
    assert "unsupported model_type 'mixtral'" in hf_import_error(path)


def test_import_refuses_missing_weights_and_pickle(tmp_path):
    path = _saved(tmp_path, "llama-gqa")
    (path / "model.safetensors").unlink()
    assert "no *.safetensors" in hf_import_error(path)
    (path / "pytorch_model.bin").write_bytes(b"not unpickled")
    assert "convert them to safetensors" in hf_import_error(path)
    assert "not a directory" in hf_import_error(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in hf_import_error(tmp_path / "empty")


def test_import_refuses_a_missing_shard(tmp_path):
    _hf_random("olmo2").save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    next((tmp_path / "hf").glob("model-00002-*.safetensors")).unlink()
    assert "is missing" in hf_import_error(tmp_path / "hf")


def test_import_refuses_weights_that_disagree_with_the_config(tmp_path):
    path = _saved(tmp_path)
    edit_hf_config(path, vocab_size=1024)
    assert "shape" in hf_import_error(path)
    edit_hf_config(path, vocab_size=VOCAB, num_hidden_layers=3)
    assert "model.layers.2" in hf_import_error(path) and "missing" in hf_import_error(path)
    edit_hf_config(path, num_hidden_layers=1)
    assert "unexpected tensor" in hf_import_error(path)


def test_import_refuses_features_our_decoder_lacks(tmp_path):
    path = _saved(tmp_path, "llama-gqa")
    edit_hf_config(path, attention_bias=True)
    assert "attention_bias" in hf_import_error(path)
    edit_hf_config(path, attention_bias=False, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    assert "rope scaling" in hf_import_error(path)
