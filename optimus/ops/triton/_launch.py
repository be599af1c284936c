"""Launch-time choices shared by the Triton kernels: interpreter workarounds and dot precision."""

from __future__ import annotations

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


def interpreting(kernel) -> bool:
    """True when `kernel` runs under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return isinstance(kernel, InterpretedFunction)


def dot_settings(kernel, dtype: torch.dtype) -> dict:
    """Constexpr arguments for tl.dot.

    The interpreter computes bf16 tl.dot wrongly, so there the operands are upcast to fp32 first.
    fp32 inputs use full precision unless the user allowed TF32 for matmuls, as torch does.
    """
    upcast = interpreting(kernel) and dtype != torch.float32
    full_fp32 = (dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32) or upcast
    # input_precision only matters for fp32 operands; "tf32" is Triton's default otherwise
    return {"DOT_IN_FP32": upcast, "PRECISION": "ieee" if full_fp32 or interpreting(kernel) else "tf32"}


def cdiv(a: int, b: int) -> int:
    """Ceiling division (for grid sizes)."""
    return triton.cdiv(a, b)
