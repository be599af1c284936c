"""The node calibration's kernel timing on a real GPU (optimus/plan/timing.kernel_time): the profiler sees the
device's kernels, and their time lies inside the host's synchronized window around the same work."""

from __future__ import annotations

import pytest
import torch

from optimus.plan import timing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU"),
]


def test_a_large_products_kernel_time_is_its_wall_time():
    """One 8,192-square bf16 product keeps the device busy for milliseconds: the host's dispatch is a sliver of it,
    so the kernels' time and the synchronized wall time agree (each the fastest of its own calls)."""
    device = torch.device("cuda")
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    kernel = timing.kernel_time(lambda: a @ b, 5, device)
    wall = timing.best_time(lambda: a @ b, 5, device)
    assert kernel is not None and 0.5 * wall < kernel < 1.2 * wall, (kernel, wall)


def test_small_kernels_cost_less_than_their_dispatch():
    """A chain of tiny autograd operators: each kernel takes microseconds, the host's dispatch and the synchronize
    most of the wall time, which kernel_time leaves out (op_overhead_us prices it)."""
    device = torch.device("cuda")
    x = torch.ones(8, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(50):
            y = y * 1.0001
        y.sum().backward()
    kernel = timing.kernel_time(chain, 3, device)
    assert kernel is not None and 0 < kernel < timing.best_time(chain, 3, device)
