"""The training dtype, chosen by what the device computes natively.

`train.dtype: auto` (the default) trains in bf16 (bf16 autocast over fp32 master weights) where the
device has bf16 matrix units: CUDA compute capability 8.0 and newer, ROCm MI200 and newer, Intel
XPU, a CPU with AVX512-BF16 or AMX whose measured bf16 matmul is not slower than fp32. Elsewhere
fp32: on an AVX2-only CPU a bf16 matmul is emulated and runs about a hundred times slower.
An explicit `bf16` on such a device still runs, with one warning that states the slowdown.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from optimus.train.hardware import CpuSpeed, cpu_speed

# ROCm architectures with bf16 matrix cores: MI200 (gfx90a), MI300 (gfx94x), MI350 (gfx95x)
_ROCM_BF16_ARCHS = ("gfx90a", "gfx94", "gfx95")


@dataclass(frozen=True)
class Precision:
    """The dtype training runs in ("fp32" or "bf16"), what was asked for, and why."""

    dtype: str
    requested: str
    reason: str
    warning: str | None = None  # set when an explicit bf16 will run slowly here
    # the warning is this rank's alone to give (its device reads unlike rank 0's, which says its own): a rank other
    # than 0 prints it
    own_warning: bool = False

    def describe(self) -> str:
        """One log line: the choice and its reason."""
        how = "train.dtype=auto" if self.requested == "auto" else f"train.dtype={self.requested}"
        return f"precision: {self.dtype} ({how}; {self.reason})"


def native_bf16(device: torch.device, cpu: CpuSpeed | None = None) -> tuple[bool, str]:
    """(whether `device` computes bf16 natively, the evidence in a few words)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.version.hip:
            arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
            return arch.startswith(_ROCM_BF16_ARCHS), f"{name} ({arch})"
        major, minor = torch.cuda.get_device_capability(device)
        return (major, minor) >= (8, 0), f"{name}, compute capability {major}.{minor}"
    if device.type == "xpu":
        supported = getattr(torch.xpu, "is_bf16_supported", lambda: True)()
        return bool(supported), torch.xpu.get_device_name(device)
    cpu = cpu or cpu_speed()
    flags = "with AVX512-BF16/AMX" if cpu.bf16_flags else "without AVX512-BF16/AMX"
    measured = (f"bf16 matmul {cpu.bf16_flops / 1e9:.3g} vs fp32 {cpu.fp32_flops / 1e9:.3g} GFLOP/s measured")
    return cpu.bf16_flags and cpu.bf16_flops >= cpu.fp32_flops, f"CPU {cpu.capability} {flags}, {measured}"


def choose_precision(requested: str, device: torch.device, cpu: CpuSpeed | None = None) -> Precision:
    """Resolve train.dtype ("auto", "fp32" or "bf16") on `device`."""
    if requested == "fp32":
        return Precision("fp32", requested, "as configured")
    if device.type == "cpu" and cpu is None:
        cpu = cpu_speed()
    native, evidence = native_bf16(device, cpu)
    if requested == "auto":
        return Precision("bf16" if native else "fp32", requested,
                         f"{'native' if native else 'no native'} bf16: {evidence}")
    if native:
        return Precision("bf16", requested, f"as configured; native bf16: {evidence}")
    slowdown = f"about {cpu.bf16_slowdown:.0f}x slower than fp32" if cpu is not None else "slower than fp32"
    warning = (f"warning: train.dtype=bf16 on a device without native bf16 ({evidence}): its matmuls run "
               f"{slowdown}; use train.dtype=auto (or fp32) here")
    return Precision("bf16", requested, f"as configured; no native bf16: {evidence}", warning)


def agree_on_precision(precision: Precision, device: torch.device) -> Precision:
    """Every rank of a job trains in rank 0's dtype. `auto` is each rank's own reading of its device, and on a CPU
    that reading is a timing: ranks whose bf16 and fp32 rates are close, one whose probe met a busy core, or nodes of
    different CPU kinds could read it either way, and ranks in different dtypes would exchange gradients that do not
    match. An explicit dtype is the same on every rank already (one config); for an explicit bf16 a rank without
    bf16 units where rank 0 has them is told to say so itself (rank 0's own warning covers the ranks like it)."""
    import torch.distributed as dist

    if precision.requested == "fp32" or not (dist.is_available() and dist.is_initialized()):
        return precision
    if dist.get_world_size() == 1:
        return precision
    # rank 0's reading (NCCL sends device tensors): its choice for auto, whether it warned for an explicit bf16
    read = precision.dtype == "bf16" if precision.requested == "auto" else precision.warning is not None
    choice = torch.tensor([read], dtype=torch.int32, device=device)
    dist.broadcast(choice, src=0)
    if precision.requested != "auto":
        if precision.warning is None or bool(choice.item()):
            return precision
        return replace(precision, own_warning=True, warning=(
            f"warning: rank {dist.get_rank()} has no native bf16, unlike rank 0, yet train.dtype=bf16 "
            f"({precision.reason}): its matmuls run slower than fp32 and every rank waits for it; use "
            "train.dtype=fp32 (or auto) for this job"))
    dtype = "bf16" if bool(choice.item()) else "fp32"
    if dtype == precision.dtype:
        return precision
    warning = None
    if dtype == "bf16":  # this rank emulates bf16 (a CPU without its units): the job runs at this rank's pace
        warning = (f"warning: rank {dist.get_rank()} trains in bf16, rank 0's choice for train.dtype=auto, without "
                   f"native bf16 here ({precision.reason}): its matmuls run slower than fp32 and every rank waits "
                   "for it; set train.dtype=fp32 for this job")
    return Precision(dtype, precision.requested, f"rank 0's choice, which every rank takes; this rank read "
                                                 f"{precision.dtype}: {precision.reason}", warning, warning is not None)
