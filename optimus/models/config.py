"""Typed architecture config: every field a decoder (dense or OLMoE-style MoE) needs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ModelConfig(BaseModel):
    """Decoder shape and MoE settings. `n_experts == 0` means dense SwiGLU blocks."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    preset: str | None = None
    d_model: int = Field(256, gt=0)
    n_layers: int = Field(4, gt=0)
    n_heads: int = Field(4, gt=0)
    n_kv_heads: int | None = Field(None, gt=0, description="None = n_heads (no GQA)")
    vocab_size: int = Field(50304, gt=0)
    ffn_hidden: int = Field(1024, gt=0, description="dense SwiGLU width")
    n_experts: int = Field(16, ge=0, description="0 = dense model")
    top_k: int = Field(4, gt=0)
    expert_ffn_hidden: int = Field(512, gt=0)
    norm_topk_prob: bool = False
    qk_norm: bool = True
    norm_placement: Literal["pre", "post"] = Field(
        "pre", description="pre: OLMoE/Llama (x + f(norm(x))); post: OLMo-2 (x + norm(f(x)))"
    )
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    aux_loss_coef: float = Field(0.01, ge=0)
    z_loss_coef: float = Field(0.001, ge=0)
    init_std: float = Field(0.02, gt=0)
    moe_impl: Literal["auto", "reference"] = Field(
        "auto", description="expert math: auto (the fastest fused ops for the device, as ops' impl='auto') or "
                            "reference (a plain per-expert loop, for debugging)")

    @field_validator("moe_impl", mode="before")
    @classmethod
    def _renamed_impl(cls, impl: object) -> object:
        if impl == "fast":  # the old name, refused rather than silently read: one name per behaviour
            raise ValueError("'fast' is now called 'auto' (as every op's impl): write model.moe_impl: auto")
        return impl

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @model_validator(mode="after")
    def _shapes_agree(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head dim d_model/n_heads ({self.head_dim}) must be even for rotary embeddings")
        if self.is_moe and self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        return self
