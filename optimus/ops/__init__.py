"""Kernels, each with a pure-torch reference; the dispatch picks an implementation per device."""

from optimus.ops.grouped_mm import grouped_mm, grouped_mm_reference
from optimus.ops.permute import permute_tokens, unpermute_tokens
from optimus.ops.swiglu import swiglu

__all__ = ["grouped_mm", "grouped_mm_reference", "permute_tokens", "unpermute_tokens", "swiglu"]
