"""Dropless Mixture-of-Experts feed-forward, as OLMoE computes it.

Router: linear to expert logits, softmax in fp32, top-k (optionally renormalised). Experts: SwiGLU
with gate and up merged into one weight. Expert math goes through `optimus.ops` on tokens sorted by
expert; there is no Python loop over experts. The experts module is the seam expert parallelism
swaps: it takes the tokens with their chosen experts and router weights and returns the weighted
sum of their experts' outputs. `GroupedExperts` runs that as one fused op
(`ops.moe_experts_forward`: permute, merged gate+up GEMM, SwiGLU, down GEMM, weighted combine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from optimus import ops
from optimus.models.config import ModelConfig


@dataclass
class RouterStats:
    """What one MoE layer reports besides its output: its loss terms and its expert load."""

    aux_loss: torch.Tensor  # load-balancing loss of this layer (1.0 * top_k when perfectly balanced)
    z_loss: torch.Tensor  # mean squared log-partition of the router logits
    expert_counts: torch.Tensor  # [n_experts] token copies routed to each expert (no grad)


def combine_router_stats(stats: list[RouterStats], n_layers: int) -> RouterStats:
    """The layers' router stats as one: aux and z-loss summed over the layers given and divided by all
    `n_layers` (so the shares of pipeline stages add up exactly), expert counts stacked [layers, n_experts]."""
    return RouterStats(
        aux_loss=torch.stack([s.aux_loss for s in stats]).sum() / n_layers,
        z_loss=torch.stack([s.z_loss for s in stats]).sum() / n_layers,
        expert_counts=torch.stack([s.expert_counts for s in stats]),
    )


def training_objective(ce_loss: torch.Tensor, aux_loss: torch.Tensor, z_loss: torch.Tensor,
                       config: ModelConfig) -> torch.Tensor:
    """The loss training minimises: cross-entropy + aux_loss_coef * load-balancing loss + z_loss_coef * z-loss."""
    return ce_loss + config.aux_loss_coef * aux_loss + config.z_loss_coef * z_loss


class Router(nn.Module):
    """Token-choice top-k router; its weight has the HF layout [n_experts, d_model]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.top_k
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.d_model))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (logits [T, E], probs fp32 [T, E], top weights [T, k] in x's dtype, top ids [T, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weights, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return logits, probs, top_weights.to(logits.dtype), top_ids


class GroupedExperts(nn.Module):
    """All experts' SwiGLU weights as stacked tensors: w_gate_up [E, D, 2F], w_down [E, F, D]."""

    def __init__(self, n_experts: int, d_model: int, hidden: int, impl: str = "auto"):
        super().__init__()
        self.impl = impl
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * hidden))
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, d_model))

    def forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """tokens [T, D], expert_ids [T, k], weights [T, k] -> [T, D]: sum_s weights[t, s] * MLP_ids[t, s](x[t])."""
        return ops.moe_experts_forward(tokens, expert_ids, weights, self.w_gate_up, self.w_down, impl=self.impl)


class MoE(nn.Module):
    """Dropless MoE block: route, sort tokens by expert, run the experts, combine by router weight."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_experts = config.n_experts
        self.router = Router(config)
        self.experts = GroupedExperts(config.n_experts, config.d_model, config.expert_ffn_hidden, config.moe_impl)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits, probs, top_weights, top_ids = self.router(tokens)
        out = self.experts(tokens, top_ids, top_weights)
        counts = ops.count_per_expert(top_ids.flatten(), self.n_experts)  # no host sync on GPU
        return out.view(shape).to(x.dtype), self._stats(logits, probs, counts)

    def _stats(self, logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor) -> RouterStats:
        n_tokens = probs.shape[0]
        # Switch/OLMoE load balancing: E * sum_e (share of token copies to e) * (mean router prob of e)
        load_share = counts.detach().to(torch.float32) / n_tokens
        aux_loss = self.n_experts * torch.dot(load_share, probs.mean(dim=0))
        z_loss = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        return RouterStats(aux_loss, z_loss, counts.detach())
