"""State-dict mapping to and from Hugging Face OLMoE, OLMo-2 and Llama layouts.

Export writes `config.json` + `model.safetensors` that `AutoModelForCausalLM.from_pretrained` loads as
`OlmoeForCausalLM` (MoE), `Olmo2ForCausalLM` (dense, post-norm, QK-norm) or `LlamaForCausalLM` (dense,
pre-norm, no QK-norm). Import reads such a folder (safetensors only, never pickle) into a ModelConfig
and a state dict for `Transformer.load_state_dict`.

The context length travels both ways: export writes the run's train.seq_len as `max_position_embeddings`
(and the tokenizer's `model_max_length`); import reads `max_position_embeddings` back (context_length_from_hf)
for the run's train.seq_len.

OLMoE experts go to disk one module per expert (`mlp.experts.{j}.gate_proj.weight`, ...), as on the
Hub: transformers 4.x loads that directly, and transformers 5 merges it on load into its fused
`gate_up_proj` [E, 2F, D] / `down_proj` [E, D, F] (and splits it again in save_pretrained). Import
accepts both layouts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from optimus.models.config import ModelConfig
from optimus.models.transformer import Transformer, build_model


class InteropError(ValueError):
    """A Hugging Face directory or export request that cannot be honoured (one-line message)."""


ARCHITECTURES = {"olmoe": "OlmoeForCausalLM", "olmo2": "Olmo2ForCausalLM", "llama": "LlamaForCausalLM"}
# The OLMoE tokenizer's ids (DESIGN.md section 3): what OLMoE and OLMo-2 ship in their configs.
PAD_ID, EOS_ID = 1, 50279
# The context an export states when its caller names none (OLMoE's). RoPE is computed on the fly here, so the number
# records the context a model was trained at rather than a limit of its weights.
MAX_POSITIONS = 4096


# ------------------------------------------------------------------------------------ name maps
def pick_format(config: ModelConfig, dense_format: str = "auto") -> str:
    """The HF model_type a config exports to: olmoe, olmo2 or llama (InteropError when none fits)."""
    if dense_format not in ("auto", "olmo2", "llama"):
        raise InteropError(f"unknown dense format '{dense_format}': choose auto, olmo2 or llama")
    pre, qk = config.norm_placement == "pre", config.qk_norm
    if config.is_moe:
        if dense_format != "auto":
            raise InteropError(f"--dense-format {dense_format} is for dense models; this one is MoE: drop the flag")
        if not (pre and qk):
            raise InteropError("HF OLMoE needs norm_placement 'pre' and qk_norm true: this MoE has no HF layout")
        return "olmoe"
    fits = {"olmo2": not pre and qk, "llama": pre and not qk}
    if dense_format == "auto":
        for name, ok in fits.items():
            if ok:
                return name
        raise InteropError(
            f"dense model with norm_placement '{config.norm_placement}' and qk_norm {qk} has no HF layout: "
            "use post-norm + QK-norm (OLMo-2) or pre-norm without QK-norm (Llama)"
        )
    if not fits[dense_format]:
        other = next((name for name, ok in fits.items() if ok), None)
        need = {"olmo2": "norm_placement 'post' and qk_norm true", "llama": "norm_placement 'pre' and qk_norm false"}
        need = need[dense_format]
        fix = f"use --dense-format {other} (or auto)" if other else "no HF dense layout fits this model"
        raise InteropError(f"--dense-format {dense_format} needs {need}: {fix}")
    return dense_format


def _name_pairs(config: ModelConfig, family: str) -> list[tuple[str, str]]:
    """(our name, HF name) of every tensor that maps one to one (all but the stacked experts)."""
    pairs = [("embed.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
             ("lm_head.weight", "lm_head.weight")]
    # OLMo-2 normalises sublayer outputs: its two norms sit after attention and after the MLP.
    norms = ("post_attention_layernorm", "post_feedforward_layernorm") if family == "olmo2" else (
        "input_layernorm", "post_attention_layernorm")
    for i in range(config.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        pairs += [(ours + "attn_norm.weight", hf + norms[0] + ".weight"),
                  (ours + "mlp_norm.weight", hf + norms[1] + ".weight")]
        pairs += [(ours + f"attn.{p}.weight", hf + f"self_attn.{p}.weight")
                  for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if config.qk_norm:
            pairs += [(ours + f"attn.{n}.weight", hf + f"self_attn.{n}.weight") for n in ("q_norm", "k_norm")]
        if config.is_moe:
            pairs.append((ours + "mlp.router.weight", hf + "mlp.gate.weight"))
        else:
            pairs += [(ours + f"mlp.{p}.weight", hf + f"mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
    return pairs


# --------------------------------------------------------------------------------------- export
def hf_config(config: ModelConfig, family: str, context_length: int = MAX_POSITIONS) -> dict:
    """The config.json transformers (4.x and 5.x) needs to rebuild this architecture; context_length (the run's
    train.seq_len) becomes max_position_embeddings."""
    out = {
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": config.expert_ffn_hidden if config.is_moe else config.ffn_hidden,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
        # transformers 5 reads rope_parameters; 4.x reads rope_theta (5 moves it into rope_parameters).
        "rope_theta": config.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": context_length, "tie_word_embeddings": False,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": config.init_std,
        "pad_token_id": PAD_ID, "bos_token_id": None, "eos_token_id": EOS_ID,
        "torch_dtype": "float32", "use_cache": True,
    }
    if family == "olmoe":
        out.update(num_experts=config.n_experts, num_experts_per_tok=config.top_k, norm_topk_prob=config.norm_topk_prob,
                   router_aux_loss_coef=config.aux_loss_coef, output_router_logits=False, clip_qkv=None)
    if family == "llama":
        out.update(head_dim=config.head_dim, mlp_bias=False, pretraining_tp=1)
    return out


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    # A model sharded with FSDP2/TP holds DTensors: gather each to a plain tensor first.
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    if t.is_meta:
        raise InteropError("the model's weights are on the meta device: load a checkpoint into it before exporting")
    return t.detach().to("cpu", torch.float32)


def to_hf_state_dict(model: Transformer, config: ModelConfig, family: str) -> dict[str, torch.Tensor]:
    """Our weights under HF names, OLMoE experts split one module per expert (the Hub layout)."""
    ours = {name: _full_tensor(t) for name, t in model.state_dict().items()}
    out = {hf: ours[name].contiguous() for name, hf in _name_pairs(config, family)}
    ffn = config.expert_ffn_hidden
    for i in range(config.n_layers if config.is_moe else 0):
        gate_up, down = ours[f"layers.{i}.mlp.experts.w_gate_up"], ours[f"layers.{i}.mlp.experts.w_down"]
        for j in range(config.n_experts):
            # Ours computes x @ W ([D, 2F] then [F, D]); nn.Linear stores the transpose.
            prefix = f"model.layers.{i}.mlp.experts.{j}."
            out[prefix + "gate_proj.weight"] = gate_up[j, :, :ffn].t().contiguous()
            out[prefix + "up_proj.weight"] = gate_up[j, :, ffn:].t().contiguous()
            out[prefix + "down_proj.weight"] = down[j].t().contiguous()
    return out


def _prepare_out_dir(out_dir: str | Path, overwrite: bool = False) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InteropError(f"'{out}' is a file: pass a directory for the export")
    if out.is_dir() and any(out.iterdir()):
        if not (out / "config.json").is_file():
            raise InteropError(f"'{out}' is not empty and holds no earlier export: choose a new or empty --out")
        if not overwrite:  # a downloaded model's folder looks the same: its weights are not ours to delete
            raise InteropError(f"'{out}' already holds a model (config.json): choose a new or empty --out, or pass "
                               "--overwrite to replace it")
        # Overwriting an earlier export: drop its weights so no stale shard or index survives.
        for old in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
            old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


@dataclass(frozen=True)
class ExportTokenizer:
    """The tokenizer a run was trained with, for the export: its tokenizer.json and special tokens."""

    path: Path  # a Hugging Face tokenizers tokenizer.json
    eos_token: str
    pad_token: str


def write_tokenizer_files(out: Path, tokenizer: ExportTokenizer,
                          context_length: int = MAX_POSITIONS) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json, so that
    AutoTokenizer.from_pretrained(out) and generate() work offline; returns the eos and pad ids.
    context_length (the run's train.seq_len) becomes the tokenizer's model_max_length."""
    from tokenizers import Tokenizer

    text = tokenizer.path.read_text()
    loaded = Tokenizer.from_str(text)
    ids = {"eos_token_id": loaded.token_to_id(tokenizer.eos_token), "pad_token_id": loaded.token_to_id(tokenizer.pad_token)}
    (out / "tokenizer.json").write_text(text)
    specials = {"eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}
    # a generic fast tokenizer over tokenizer.json: no BOS added (OLMoE and OLMo-2 train without one)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "bos_token": None,
                        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                        "model_max_length": context_length}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    generation = {"bos_token_id": None, **ids, "do_sample": False}  # greedy by default, as `optimus generate`
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ids


def export_hf(model: Transformer, config: ModelConfig, out_dir: str | Path, dense_format: str = "auto",
              tokenizer: ExportTokenizer | None = None, overwrite: bool = False,
              context_length: int = MAX_POSITIONS) -> Path:
    """Write `config.json` and `model.safetensors` (fp32) that transformers' from_pretrained loads, and,
    given the run's tokenizer, its files (see write_tokenizer_files).

    MoE models become OlmoeForCausalLM; dense ones Olmo2ForCausalLM or LlamaForCausalLM, chosen by
    norm placement and QK-norm when dense_format is "auto". context_length, the run's train.seq_len, is written as
    max_position_embeddings and model_max_length. A folder holding a model already is refused unless
    `overwrite`. Returns the output directory.
    """
    family = pick_format(config, dense_format)
    tensors = to_hf_state_dict(model, config, family)
    out = _prepare_out_dir(out_dir, overwrite)
    hf = hf_config(config, family, context_length)
    if tokenizer is not None:
        hf.update(write_tokenizer_files(out, tokenizer, context_length))
    # config.json before the weights: a folder left half-written by a crash then counts as an export to redo.
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})  # transformers checks format == "pt"
    tmp.chmod(_new_file_mode())
    tmp.replace(out / "model.safetensors")
    return out


def _new_file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0644 under the usual 022).

    safetensors' save_file writes through a private temporary file (mode 0600) that it renames: without this,
    other users of a shared filesystem could not read the exported weights."""
    umask = os.umask(0o077)  # the umask can only be read by setting it: set a strict one for that instant
    os.umask(umask)
    return 0o666 & ~umask


# --------------------------------------------------------------------------------------- import
def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig for an HF config.json dict (olmoe, olmo2 or llama)."""
    family = hf.get("model_type")
    if family not in ARCHITECTURES:
        raise InteropError(f"unsupported model_type '{family}': Optimus imports {', '.join(ARCHITECTURES)} checkpoints")
    _check_whole_numbers(hf)
    _check_supported(hf, family)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    fields = dict(
        d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=_kv_heads(hf), vocab_size=hf["vocab_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=theta, init_std=hf.get("initializer_range", 0.02),
        qk_norm=family != "llama", norm_placement="post" if family == "olmo2" else "pre",
    )
    if family == "olmoe":
        fields.update(n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                      expert_ffn_hidden=hf["intermediate_size"], norm_topk_prob=hf.get("norm_topk_prob", False),
                      aux_loss_coef=hf.get("router_aux_loss_coef", 0.01))
    else:  # dense: no router, so no router losses
        fields.update(n_experts=0, ffn_hidden=hf["intermediate_size"], aux_loss_coef=0.0, z_loss_coef=0.0)
    try:
        return ModelConfig(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        raise InteropError(f"config.json does not describe a model Optimus can build: {first['msg']}") from None


# config.json's integer fields (those present): JSON true would pass as 1 and "64" or 64.0 as 64 without this check
_INTEGER_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                   "intermediate_size", "num_experts", "num_experts_per_tok", "head_dim")


def _check_whole_numbers(hf: dict) -> None:
    for name in _INTEGER_FIELDS:
        value = hf.get(name)
        optional = name in ("num_key_value_heads", "head_dim")  # null: derived from the heads
        if (value is None and optional) or name not in hf:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise InteropError(f"config.json field {name} must be a whole number (got {json.dumps(value)}): "
                               "is it an HF config.json?")


def _kv_heads(hf: dict) -> int | None:
    kv = hf.get("num_key_value_heads")
    return None if kv in (None, hf["num_attention_heads"]) else kv  # None: plain multi-head attention


def _check_supported(hf: dict, family: str) -> None:
    # Features transformers has but our decoder does not: refuse rather than import something else.
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") not in ("silu", "swish"),
        "attention_bias": bool(hf.get("attention_bias")), "mlp_bias": bool(hf.get("mlp_bias")),
        "clip_qkv": hf.get("clip_qkv") is not None,
    }
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    unsupported["rope scaling"] = rope.get("rope_type", rope.get("type", "default")) != "default"
    head_dim = hf.get("head_dim")
    unsupported["head_dim"] = head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise InteropError(f"this {family} checkpoint uses {', '.join(bad)}, which Optimus's decoder lacks")


def read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors file(s), sharded or not; never unpickles anything."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        shard_names = _shards_in_index(index)
        missing = [name for name in shard_names if not (hf_dir / name).is_file()]
        if missing:
            raise InteropError(f"shard '{missing[0]}' listed in {index.name} is missing from '{hf_dir}': "
                               "copy the whole folder")
        files = [hf_dir / name for name in shard_names]
    elif (hf_dir / "model.safetensors").is_file():
        files = [hf_dir / "model.safetensors"]
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        if list(hf_dir.glob("*.bin")) or list(hf_dir.glob("*.pt")) or list(hf_dir.glob("*.pth")):
            raise InteropError(f"'{hf_dir}' holds only pickle weights (*.bin), which Optimus never loads: "
                               "convert them to safetensors (save_pretrained(..., safe_serialization=True))")
        raise InteropError(f"no *.safetensors weights in '{hf_dir}': export the model with save_pretrained first")
    tensors: dict[str, torch.Tensor] = {}
    source: dict[str, Path] = {}  # tensor name -> the file it came from
    for path in files:
        try:
            loaded = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as err:  # truncated, random or not safetensors at all
            detail = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
            raise InteropError(f"'{path}' is not a readable safetensors file ({detail}): copy it again "
                               "from its source") from None
        # Two copies of one tensor (a stale shard beside a newer file): which is meant cannot be told.
        twice = next((name for name in sorted(loaded) if name in source), None)
        if twice is not None:
            raise InteropError(f"tensor '{twice}' is in both '{source[twice].name}' and '{path.name}' in "
                               f"'{hf_dir}': remove the stale file so each tensor is stored once")
        tensors.update(loaded)
        source.update(dict.fromkeys(loaded, path))
    return tensors


def _shards_in_index(index: Path) -> list[str]:
    """The shard file names a model.safetensors.index.json maps tensors to."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as err:
        raise InteropError(f"{index.name} in '{index.parent}' is malformed ({type(err).__name__}): it needs a "
                           '"weight_map" object of tensor name -> shard file') from None
    bad = [name for name in names if not isinstance(name, str) or "/" in name or name in ("", ".", "..")]
    if bad:
        raise InteropError(f"{index.name} in '{index.parent}' names shard {bad[0]!r}, which is not a file name "
                           "in that folder")
    return names


def state_dict_from_hf(
    tensors: dict[str, torch.Tensor], config: ModelConfig, family: str, tied: bool = False
) -> dict[str, torch.Tensor]:
    """HF tensors -> our state dict (fp32), checked name by name, shape by shape and for NaN/inf against our model.

    tied: config.json's tie_word_embeddings is true: the embedding is the head (a stored lm_head is ignored, as in
    transformers); otherwise a missing lm_head.weight is an InteropError."""
    # A bare base model (OlmoeModel, ...) saves without the "model." prefix and without lm_head.
    if not any(k.startswith("model.") for k in tensors):
        tensors = {("model." + k if k != "lm_head.weight" else k): v for k, v in tensors.items()}
    if tied and "model.embed_tokens.weight" in tensors:
        # Tied in HF (the head IS the embedding; transformers ignores a stored head then), separate here.
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    elif not tied and "lm_head.weight" not in tensors:
        raise InteropError("the weights have no lm_head.weight and config.json does not set tie_word_embeddings: "
                           "true: add the head's weights, or set the flag if the model shares its embeddings")
    pool = dict(tensors)
    out = {ours: _take(pool, hf) for ours, hf in _name_pairs(config, family)}
    for i in range(config.n_layers if config.is_moe else 0):
        out.update(_take_experts(pool, i, config))
    leftovers = [k for k in pool if not k.endswith("rotary_emb.inv_freq")]  # old checkpoints kept RoPE buffers
    if leftovers:
        more = f" (+{len(leftovers) - 1} more)" if len(leftovers) > 1 else ""
        raise InteropError(f"unexpected tensor '{leftovers[0]}'{more} for a {family} model of this config: "
                           "is config.json from the same checkpoint?")
    expected = build_model(config, device="meta").state_dict()
    for name, shape in ((n, t.shape) for n, t in expected.items()):
        if out[name].shape != shape:
            raise InteropError(f"tensor for '{name}' has shape {tuple(out[name].shape)}, the config implies "
                               f"{tuple(shape)}: config.json and the weights disagree")
    return out


def _take(pool: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in pool:
        raise InteropError(f"tensor '{name}' is missing from the safetensors files: is the checkpoint complete?")
    tensor = pool.pop(name).to(torch.float32)
    if not torch.isfinite(tensor).all():
        raise InteropError(f"tensor '{name}' holds NaN or inf values: the checkpoint is corrupt or from a diverged "
                           "run; import a healthy one")
    return tensor


def _take_experts(pool: dict[str, torch.Tensor], layer: int, config: ModelConfig) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}.mlp.experts."
    if prefix + "gate_up_proj" in pool:  # transformers 5's fused layout: [E, 2F, D] and [E, D, F]
        gate_up, down = _take(pool, prefix + "gate_up_proj"), _take(pool, prefix + "down_proj")
        if gate_up.ndim != 3 or down.ndim != 3:
            raise InteropError(f"fused experts of layer {layer} are not 3-d tensors: unsupported expert layout")
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    else:  # the Hub's layout: one nn.Linear triple per expert
        per_expert = [[_take(pool, f"{prefix}{j}.{p}.weight").t() for p in ("gate_proj", "up_proj", "down_proj")]
                      for j in range(config.n_experts)]
        try:
            gate_up = torch.stack([torch.cat([g, u], dim=1) for g, u, _ in per_expert])
            down = torch.stack([d for _, _, d in per_expert])
        except RuntimeError:
            raise InteropError(f"the experts of layer {layer} differ in shape: the checkpoint is corrupt") from None
    ours = f"layers.{layer}.mlp.experts."
    return {ours + "w_gate_up": gate_up.contiguous(), ours + "w_down": down.contiguous()}


def read_hf_config(hf_dir: str | Path) -> dict:
    """The config.json of an HF model folder as a dict (InteropError when the folder or the file is unusable)."""
    folder = Path(hf_dir)
    if not folder.is_dir():
        raise InteropError(f"'{folder}' is not a directory: pass a Hugging Face model folder "
                           "(config.json + *.safetensors)")
    if not (folder / "config.json").is_file():
        raise InteropError(f"no config.json in '{folder}': pass the folder save_pretrained wrote")
    try:
        hf = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise InteropError(f"config.json in '{folder}' is not valid JSON ({err.msg}, line {err.lineno})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InteropError(f"config.json in '{folder}' cannot be read ({type(err).__name__})") from None
    if not isinstance(hf, dict):
        raise InteropError(f"config.json in '{folder}' holds a {type(hf).__name__}, not a JSON object: "
                           "pass the config.json save_pretrained wrote")
    return hf


def context_length_from_hf(hf: dict) -> int | None:
    """config.json's max_position_embeddings, the context the model was trained at; None when it is absent or null.

    Refused (InteropError) when it is not a positive whole number: a run must not train at a guessed context."""
    value = hf.get("max_position_embeddings")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InteropError(f"config.json field max_position_embeddings must be a positive whole number (got "
                           f"{json.dumps(value)}): set it to the context the model was trained at, or delete it "
                           "and pass --train.seq_len=N to optimus train")
    return value


def import_hf(hf_dir: str | Path, hf: dict | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF OLMoE / OLMo-2 / Llama folder: (our ModelConfig, state dict for Transformer.load_state_dict).

    Reads config.json (unless the caller passes what read_hf_config gave it, as `hf`) and safetensors weights
    (single file or sharded with an index); refuses pickle (*.bin) weights, unsupported architectures and weights
    that do not match the config. The context length is not part of the model: context_length_from_hf reads it.
    """
    folder = Path(hf_dir)
    hf = read_hf_config(folder) if hf is None else hf
    try:
        config = config_from_hf(hf)
    except KeyError as err:
        raise InteropError(f"config.json in '{folder}' lacks the field {err}: is it a complete HF config?") from None
    except (TypeError, AttributeError) as err:
        raise InteropError(f"config.json in '{folder}' has a field of the wrong type ({err}): is it an HF "
                           "config.json?") from None
    tensors = read_safetensors(folder)
    # Olmoe/Olmo2/LlamaConfig default tie_word_embeddings to false: tie only where config.json says so
    tied = hf.get("tie_word_embeddings") is True
    return config, state_dict_from_hf(tensors, config, hf["model_type"], tied=tied)
