"""Typed settings of the optimizer and its schedule (the `optim:` config section)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OptimConfig(BaseModel):
    """AdamW and its learning-rate schedule, weight decay and gradient clipping."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    lr: float = Field(4e-4, gt=0)
    min_lr: float = Field(4e-5, ge=0)
    warmup_steps: int = Field(10, ge=0)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = Field(0.2, gt=0, le=1, description="WSD: fraction of steps spent decaying")
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="0 = no clipping")
    clip_after_warmup: bool = Field(
        False, description="clip only once warm-up is over (the published Mula runs); the norm is logged throughout")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas
