"""The decoder: token embedding, dense or MoE blocks, final norm, LM head; returns logits or losses.

Single-device code: parallelism is applied from outside (optimus.parallel) by functions that take
this model and a mesh. Blocks live in a ModuleDict keyed by layer index so that a pipeline stage
can drop the blocks it does not own and keep the names (and checkpoint keys) of the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from optimus.models.attention import Attention
from optimus.models.config import ModelConfig
from optimus.models.init import initial_rows
from optimus.models.layers import LMHead, RMSNorm, SwiGLUMLP, rotary_cos_sin
from optimus.models.moe import MoE, RouterStats, combine_router_stats, training_objective


class Block(nn.Module):
    """Attention then feed-forward, each with a residual; norms before (OLMoE) or after (OLMo-2)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.post_norm = config.norm_placement == "post"
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MoE(config) if config.is_moe else SwiGLUMLP(config.d_model, config.ffn_hidden)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, RouterStats | None]:
        if self.post_norm:
            h = h + self.attn_norm(self.attn(h, cos, sin))
            mlp_out, stats = self._mlp(h)
            return h + self.mlp_norm(mlp_out), stats
        h = h + self.attn(self.attn_norm(h), cos, sin)
        mlp_out, stats = self._mlp(self.mlp_norm(h))
        return h + mlp_out, stats

    def _mlp(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats | None]:
        if isinstance(self.mlp, MoE):
            return self.mlp(x)
        return self.mlp(x), None


@dataclass
class ModelOutput:
    """`loss` is the training objective: ce_loss + aux_loss_coef * aux_loss + z_loss_coef * z_loss."""

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    expert_counts: torch.Tensor | None = None  # [moe layers here, n_experts]


class Transformer(nn.Module):
    """Decoder-only language model (OLMoE when config.n_experts > 0, else a dense decoder)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = LMHead(config.d_model, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        """input_ids [B, S] -> logits [B, S, V]; with labels [B, S], the losses instead of logits."""
        h = self.embed(input_ids)
        cos, sin = rotary_cos_sin(
            input_ids.shape[1], self.config.head_dim, self.config.rope_theta, h.device, h.dtype
        )
        router_stats: list[RouterStats] = []
        for block in self.layers.values():
            h, stats = block(h, cos, sin)
            if stats is not None:
                router_stats.append(stats)
        h = self.norm(h)
        if labels is None:
            return ModelOutput(logits=self.lm_head(h))
        ce_loss = self.lm_head.cross_entropy(h, labels)
        return self._assemble_loss(ce_loss, router_stats)

    def _assemble_loss(self, ce_loss: torch.Tensor, router_stats: list[RouterStats]) -> ModelOutput:
        if not router_stats:
            return ModelOutput(loss=ce_loss, ce_loss=ce_loss)
        total = combine_router_stats(router_stats, self.config.n_layers)
        loss = training_objective(ce_loss, total.aux_loss, total.z_loss, self.config)
        return ModelOutput(loss=loss, ce_loss=ce_loss, aux_loss=total.aux_loss, z_loss=total.z_loss,
                           expert_counts=total.expert_counts)

    def initial_std(self, name: str) -> float | None:
        """The init of parameter `name`: normal(0, std), or None for ones (norm weights)."""
        if name.endswith("norm.weight"):
            return None
        # Output projections scaled down with depth (GPT-2 style) to keep the residual stream tame
        is_output = name.endswith(("o_proj.weight", "down_proj.weight", "w_down"))
        return self.config.init_std / math.sqrt(2 * self.config.n_layers) if is_output else self.config.init_std

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter in place from `seed` (models/init.py: the same values that
        each rank of a sharded model computes for its own shard)."""
        for name, param in self.named_parameters():
            values = initial_rows(seed, name, tuple(param.shape), self.initial_std(name), 0, param.shape[0])
            param.copy_(values)


def build_model(config: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Transformer:
    """Build on the meta device, then materialise on `device` and initialise (seeded if given)."""
    with torch.device("meta"):
        model = Transformer(config)
    if str(device) == "meta":
        return model
    model.to_empty(device=device)
    if seed is None:  # unseeded: draw one from the global generator, so torch.manual_seed still rules
        seed = int(torch.randint(0, 2**62, ()).item())
    model.init_weights(seed)
    return model
