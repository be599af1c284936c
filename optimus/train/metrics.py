"""Throughput, MFU and router-load figures for the training log.

MFU is model FLOPs per second over the device's peak. GPU peaks come from the vendor sheet; on CPU
the peak is measured once (a large matmul in the training dtype) and cached, and the log says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

# Dense bf16 peak TFLOP/s per device (vendor figures, no sparsity).
_KNOWN_PEAKS_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "MI250X": 191.5, "MI300X": 1307.0}


def _cpu_peak_cache_path() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "optimus" / "cpu_peak.json"


def measure_matmul_flops(dtype: torch.dtype, size: int = 2048, seconds: float = 1.0) -> float:
    """Best-of measured FLOP/s of a square matmul on the CPU in `dtype`."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b  # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, how it was obtained) for MFU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in _KNOWN_PEAKS_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{name} datasheet"
        return measure_matmul_flops(dtype, size=8192), f"{name} measured"
    key = hashlib.sha1(
        f"{platform.processor()}|{platform.machine()}|{torch.get_num_threads()}|{dtype}|{torch.__version__}".encode()
    ).hexdigest()[:16]
    path = _cpu_peak_cache_path()
    cache = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
    if key not in cache:
        cache[key] = measure_matmul_flops(dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, path)
    return cache[key], f"measured CPU matmul peak ({torch.get_num_threads()} threads, {dtype}), cached"


class Throughput:
    """Tokens/s and MFU over the steps since the last report."""

    def __init__(self, flops_per_token: float, peak_flops: float):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._tokens = 0
        self._start = time.perf_counter()

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def report(self) -> tuple[float, float]:
        """(tokens per second, MFU) since the previous report; resets the window."""
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        tokens_per_s = self._tokens / elapsed
        self._tokens, self._start = 0, time.perf_counter()
        return tokens_per_s, tokens_per_s * self.flops_per_token / self.peak_flops


def expert_load_summary(expert_counts: torch.Tensor) -> dict[str, float]:
    """Max and min expert load relative to a perfectly even split, over all MoE layers [L, E]."""
    counts = expert_counts.to(torch.float64)
    even = counts.sum(dim=1, keepdim=True) / counts.shape[1]
    relative = counts / even.clamp(min=1e-9)
    return {"expert_load_max": relative.max().item(), "expert_load_min": relative.min().item()}
