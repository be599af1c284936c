"""SwiGLU activation on a merged gate+up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2F] with the gate in the first half -> silu(gate) * up, [..., F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
