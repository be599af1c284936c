"""Token permutation for dropless MoE: gather token copies into expert order, and back."""

from __future__ import annotations

import torch


def permute_tokens(
    x: torch.Tensor, expert_ids: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, D]; expert_ids: [T, k] -> (rows [T*k, D] sorted by expert, order [T*k], counts [E]).

    `order[j]` is the flat (token * k + slot) index of sorted row j; ties keep token order.
    """
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=n_experts)
    return x.index_select(0, order // top_k), order, counts


def unpermute_tokens(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of permute_tokens with the router-weight combine: -> [T, D] = sum_k w[t, k] * row."""
    n_tokens, top_k = weights.shape
    unsorted = torch.empty_like(rows).index_copy_(0, order, rows)
    unsorted = unsorted.view(n_tokens, top_k, -1) * weights.unsqueeze(-1).to(rows.dtype)
    return unsorted.sum(dim=1)
