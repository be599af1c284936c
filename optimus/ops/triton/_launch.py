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
    fp32 operands get full precision unless the user allowed TF32 for matmuls (as torch does),
    and only on NVIDIA, where "tf32" is always accepted; other operands keep the backend default.
    """
    upcast = interpreting(kernel) and dtype != torch.float32
    if interpreting(kernel):
        precision = "ieee"
    elif dtype == torch.float32:
        tf32 = torch.backends.cuda.matmul.allow_tf32 and torch.version.hip is None and torch.cuda.is_available()
        precision = "tf32" if tf32 else "ieee"
    else:
        precision = None
    return {"DOT_IN_FP32": upcast, "PRECISION": precision}


def cdiv(a: int, b: int) -> int:
    """Ceiling division (for grid sizes)."""
    return triton.cdiv(a, b)
