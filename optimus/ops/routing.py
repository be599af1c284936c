"""Bookkeeping shared by the expert kernels: group sizes, and the token <-> sorted-row maps.

A dropless MoE layer sorts the T*k (token, slot) pairs by expert. Every kernel then needs the
same few index tensors in a different form (host list for a Python loop over groups, int32
offsets for torch._grouped_mm and Triton, the inverse permutation for the combine), so they are
built once here instead of once per kernel.
"""

from __future__ import annotations

from functools import cached_property

import torch


class Groups:
    """Sizes of consecutive row groups (one group per expert), in the forms kernels want."""

    def __init__(self, counts: torch.Tensor):
        if counts.dim() != 1:
            raise ValueError(f"counts must be 1-D (one entry per expert), got shape {tuple(counts.shape)}")
        self.counts = counts

    @property
    def n_groups(self) -> int:
        """Number of groups (experts), empty ones included."""
        return self.counts.numel()

    @cached_property
    def host(self) -> list[int]:
        """Group sizes as Python ints (a device sync on accelerators, free on CPU)."""
        return self.counts.tolist()

    @cached_property
    def ends(self) -> torch.Tensor:
        """int32 cumulative row counts: group e owns rows [ends[e-1], ends[e]) (torch._grouped_mm's `offs`)."""
        return torch.cumsum(self.counts, dim=0, dtype=torch.int32)

    def spans(self):
        """Yield (group, first_row, stop_row) for every non-empty group, in order."""
        start = 0
        for group, count in enumerate(self.host):
            if count:
                yield group, start, start + count
            start += count


def count_per_expert(flat_expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """int64 number of entries per expert, without a host sync on accelerators (nor a graph break
    under torch.compile: bincount's output size depends on the data)."""
    if flat_expert_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        return torch.bincount(flat_expert_ids, minlength=n_experts)
    # bincount reads max() back to the host; a scatter-add into a fixed-size buffer does not
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat_expert_ids.device)
    return counts.scatter_add_(0, flat_expert_ids, torch.ones_like(flat_expert_ids, dtype=torch.int64))


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """position[order[j]] = j: where each original entry landed after sorting."""
    positions = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return torch.empty_like(order).scatter_(0, order, positions)


class Routing:
    """How the T*k (token, slot) pairs map to expert-sorted rows.

    order[j]        flat slot index (token * k + slot) of sorted row j (stable: ties keep token order)
    token_of_row[j] token that sorted row j is a copy of (order // k)
    row_of_slot[i]  sorted row of flat slot i (the inverse of order), viewed [T, k] for the combine
    groups          rows per expert
    """

    def __init__(self, order: torch.Tensor, counts: torch.Tensor | None, top_k: int):
        if top_k < 1 or order.numel() % top_k:
            raise ValueError(f"{order.numel()} sorted rows is not a multiple of top_k={top_k}")
        self.order = order
        self.top_k = top_k
        # None when only the permutation matters (unpermute_tokens is given no counts)
        self.groups = Groups(counts) if counts is not None else None

    @classmethod
    def from_expert_ids(cls, expert_ids: torch.Tensor, n_experts: int) -> "Routing":
        """Sort the [T, k] expert choices by expert (stable) and count rows per expert."""
        if expert_ids.dim() != 2:
            raise ValueError(f"expert_ids must be [tokens, top_k], got shape {tuple(expert_ids.shape)}")
        flat_ids = expert_ids.reshape(-1).long()
        order = torch.argsort(flat_ids, stable=True)
        return cls(order, count_per_expert(flat_ids, n_experts), expert_ids.shape[1])

    @property
    def n_tokens(self) -> int:
        """T, the number of distinct tokens."""
        return self.order.numel() // self.top_k

    @cached_property
    def token_of_row(self) -> torch.Tensor:
        """[M] token index of every sorted row."""
        return torch.div(self.order, self.top_k, rounding_mode="floor")

    @cached_property
    def row_of_slot(self) -> torch.Tensor:
        """[T, k] sorted row holding each (token, slot) pair."""
        return inverse_permutation(self.order).view(self.n_tokens, self.top_k)
