"""build_optimizer's AdamW kernel: fused wherever torch has the kernel for the parameters' device."""

from __future__ import annotations

import torch

from optimus.optim.build import adamw_kernel, fused_adamw_runs_on


def test_adamw_is_fused_on_every_device_torch_fuses_it_on_and_foreach_elsewhere():
    # xpu is Aurora's: a hard-coded ("cpu", "cuda") once left it on the slower foreach kernel
    assert all(fused_adamw_runs_on(kind) for kind in ("cpu", "cuda", "xpu"))
    assert not fused_adamw_runs_on("meta")
    assert adamw_kernel([{"params": [torch.nn.Parameter(torch.zeros(2))]}]) == {"fused": True}
    assert adamw_kernel([{"params": [torch.nn.Parameter(torch.zeros(2, device="meta"))]}]) == {"foreach": True}
