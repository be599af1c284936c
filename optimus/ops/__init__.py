"""Kernels, each with a pure-torch reference; the dispatch picks an implementation per device.

Every op takes `impl`: "auto" (the fastest known for the tensors' device), "reference" (plain
torch, the ground truth), "torch" (fast, no Triton) or "triton" (our kernels in ops/triton/;
on CPU only under TRITON_INTERPRET=1). grouped_mm also accepts "loop" (one BLAS call per group).
"""

from optimus.ops.experts import expert_mlp, expert_mlp_reference, moe_experts_forward, moe_experts_reference
from optimus.ops.grouped_mm import grouped_mm, grouped_mm_reference
from optimus.ops.permute import (
    permute_tokens,
    permute_tokens_reference,
    unpermute_tokens,
    unpermute_tokens_reference,
)
from optimus.ops.routing import count_per_expert
from optimus.ops.swiglu import swiglu, swiglu_reference

__all__ = [
    "count_per_expert",
    "expert_mlp",
    "expert_mlp_reference",
    "grouped_mm",
    "grouped_mm_reference",
    "moe_experts_forward",
    "moe_experts_reference",
    "permute_tokens",
    "permute_tokens_reference",
    "swiglu",
    "swiglu_reference",
    "unpermute_tokens",
    "unpermute_tokens_reference",
]
