"""What each device can run: the facts the `impl="auto"` dispatch of every op is built on."""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch

# Accepted by every op; "auto" picks per device, "reference" is the pure-torch ground truth.
IMPLS = ("auto", "reference", "torch", "triton")


def check_impl(impl: str, allowed: tuple[str, ...] = IMPLS) -> None:
    """Raise a readable error for an unknown implementation name."""
    if impl not in allowed:
        raise ValueError(f"unknown impl '{impl}': choose one of {allowed}")


@lru_cache(maxsize=None)
def triton_installed() -> bool:
    """True when the optional `triton` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_runs_on(device: torch.device) -> bool:
    """Triton compiles for CUDA (NVIDIA and ROCm) and Intel XPU; on CPU only its interpreter runs."""
    return triton_installed() and device.type in ("cuda", "xpu")


def torch_grouped_mm_fast_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether PyTorch's own grouped GEMM is a native kernel here (CUDA sm90+ in bf16), not a loop."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda" or torch.version.hip is not None:
        return False
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)


def torch_grouped_mm_accepts(*tensors: torch.Tensor) -> bool:
    """torch._grouped_mm wants every stride (but the unit one) to be a multiple of 16 bytes."""
    for tensor in tensors:
        for size, stride in zip(tensor.shape, tensor.stride()):
            if size > 1 and stride != 1 and (stride * tensor.element_size()) % 16:
                return False
    return True


def compute_dtype(activation: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype expert math runs in: autocast's when it is on (our ops are not autocast-aware
    by themselves), otherwise the weights' (as transformers does)."""
    device_type = activation.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype
