"""Named architectures. Shapes from ../shared/REFERENCE.md (OLMoE-1B-7B scaled for the Mula family)."""

from __future__ import annotations

from optimus.models.config import ModelConfig

_OLMOE = dict(
    d_model=2048, n_layers=16, n_heads=16, vocab_size=50304, n_experts=64, top_k=8,
    expert_ffn_hidden=1024, norm_topk_prob=False, qk_norm=True, rope_theta=10000.0,
    aux_loss_coef=0.01, z_loss_coef=0.001,
)

PRESETS: dict[str, ModelConfig] = {
    "olmoe-1b-7b": ModelConfig(preset="olmoe-1b-7b", **_OLMOE),
    "mula-7b-a1b": ModelConfig(preset="mula-7b-a1b", **_OLMOE),
    "mula-20b-a2b": ModelConfig(preset="mula-20b-a2b", **{**_OLMOE, "n_layers": 32, "n_experts": 96}),
    "mula-100b-a7b": ModelConfig(
        preset="mula-100b-a7b",
        **{**_OLMOE, "d_model": 3072, "n_layers": 48, "n_heads": 24, "n_experts": 144, "expert_ffn_hidden": 1536},
    ),
    "mula-220b-a10b": ModelConfig(
        preset="mula-220b-a10b",
        **{**_OLMOE, "d_model": 3072, "n_layers": 64, "n_heads": 24, "n_experts": 240, "expert_ffn_hidden": 1536},
    ),
    # Dense Mula-1B in the OLMo-2 block style (post-norm, QK-norm), exportable as Olmo2ForCausalLM.
    "mula-1b": ModelConfig(
        preset="mula-1b", d_model=2048, n_layers=16, n_heads=16, vocab_size=50304, n_experts=0,
        ffn_hidden=8192, qk_norm=True, norm_placement="post", norm_eps=1e-6, rope_theta=500000.0,
        aux_loss_coef=0.0, z_loss_coef=0.0,
    ),
    # CPU sizes: the default `make train` job and the tests.
    "mula-tiny-moe": ModelConfig(
        preset="mula-tiny-moe", d_model=256, n_layers=4, n_heads=4, vocab_size=50304, n_experts=16, top_k=4,
        expert_ffn_hidden=512, qk_norm=True,
    ),
    "mula-tiny-dense": ModelConfig(
        preset="mula-tiny-dense", d_model=256, n_layers=4, n_heads=4, vocab_size=50304, n_experts=0,
        ffn_hidden=1024, qk_norm=True, norm_placement="post", norm_eps=1e-6, aux_loss_coef=0.0, z_loss_coef=0.0,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset's config (a copy); raises KeyError naming the choices."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset '{name}': choose one of {', '.join(sorted(PRESETS))}")
    return PRESETS[name].model_copy()
