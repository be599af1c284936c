"""What the device computes, and how fast: peak FLOP/s by SKU and dtype, native bf16 or not.

Accelerator peaks come from the vendors' datasheets (dense, no sparsity), per device as torch sees
it: one GCD of an MI250X, one tile of a Ponte Vecchio card. A CPU has no datasheet figure we can
trust, so its fp32 and bf16 matmul rates are measured (best of several probes) and cached per
machine: the cache key names the host, the CPU model, the kernel capability torch dispatches to
and the thread count, so another machine, or the same one under `ATEN_CPU_CAPABILITY=avx2`, is
measured afresh.
"""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from optimus.atomic_write import write_text_whole

# (name fragment as torch reports the device, bf16 TFLOP/s, fp32 TFLOP/s, source). First match wins,
# so the more specific names (H100 PCIe, H100 NVL, GH200) come before the ones they contain (H100, H200). fp32 is the
# non-tensor-core rate: PyTorch does not use TF32 for fp32 matmuls unless asked to.
DEVICE_PEAKS_TFLOPS: tuple[tuple[str, float, float, str], ...] = (
    ("H100 PCIe", 756.0, 51.2, "NVIDIA H100 datasheet (PCIe)"),
    ("H100 NVL", 835.0, 60.0, "NVIDIA H100 datasheet (NVL)"),
    ("H100", 989.4, 66.9, "NVIDIA H100 datasheet (SXM5)"),
    ("GH200", 989.4, 66.9, "NVIDIA GH200 datasheet"),
    ("H200 NVL", 835.0, 60.0, "NVIDIA H200 datasheet (NVL)"),
    ("H200", 989.4, 66.9, "NVIDIA H200 datasheet (SXM)"),
    ("A100", 312.0, 19.5, "NVIDIA A100 datasheet"),
    ("MI300X", 1307.4, 163.4, "AMD Instinct MI300X datasheet"),
    ("MI300A", 980.6, 122.6, "AMD Instinct MI300A datasheet"),
    ("MI250X", 191.5, 47.9, "AMD Instinct MI250X datasheet, per GCD (383 / 95.7 TFLOP/s per card of 2)"),
    ("Max 1550", 419.4, 26.2, "Intel Data Center GPU Max 1550 datasheet, per tile (2 per card)"),
)

CPU_FP32_FLOOR_PER_THREAD = 1e9  # any x86/Arm core with SIMD FMA does more; below it a probe was starved


@dataclass(frozen=True)
class CpuSpeed:
    """Measured matmul rates of this CPU with this process's threads, and what its flags say."""

    fp32_flops: float
    bf16_flops: float
    capability: str  # the kernel level torch dispatches to: "AVX2", "AVX512", ...
    bf16_flags: bool  # AVX512-BF16 or AMX present

    @property
    def bf16_slowdown(self) -> float:
        """How many times slower a bf16 matmul runs than an fp32 one (below 1: bf16 is faster)."""
        return self.fp32_flops / max(self.bf16_flops, 1.0)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_bf16_flags() -> bool:
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def best_matmul_rate(dtype: torch.dtype, size: int, seconds: float, device: torch.device | None = None,
                     min_repeats: int = 3) -> float:
    """Best FLOP/s of a square `size` matmul in `dtype` over `seconds` (at least `min_repeats` timed runs)."""
    device = device or torch.device("cpu")
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    # an accelerator runs the matmul after the call returns: time it to its end (cuda and ROCm, xpu, mps alike)
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    sync = getattr(backend, "synchronize", None) or (lambda: None)
    a @ b  # warm-up: first-call dispatch and allocation
    sync()
    best, repeats, deadline = 0.0, 0, time.perf_counter() + seconds
    while repeats < min_repeats or time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
        repeats += 1
    return best


# A probe matmul is tried at a larger size only if one of it would take at most this long at the rate seen so far:
# on a busy machine the small probes can misjudge emulated bf16 as native, and one 2048 matmul of emulated bf16
# (~0.1 GFLOP/s here) would take three minutes
MAX_PROBE_MATMUL_S = 0.25


def measure_cpu_speed() -> CpuSpeed:
    """Probe fp32 and bf16 matmul rates (about 2 s; well under 1 s for bf16 on a CPU without it).

    bf16 is first tried small: where it is emulated (a hundred times slower) a large probe would take
    minutes and tells nothing more. Large sizes give the peak MFU is read against; each is tried only
    where one matmul of it is quick at the rate the smaller size gave (MAX_PROBE_MATMUL_S).
    """
    fp32_small = best_matmul_rate(torch.float32, 256, 0.05)
    bf16_small = best_matmul_rate(torch.bfloat16, 256, 0.05, min_repeats=2)
    fp32 = max(best_matmul_rate(torch.float32, 1024, 0.3), best_matmul_rate(torch.float32, 2048, 0.6))
    bf16 = bf16_small
    if bf16_small >= 0.5 * fp32_small:  # perhaps native: its peak needs large matmuls
        for size, seconds in ((1024, 0.3), (2048, 0.6)):
            if 2 * size**3 / bf16 > MAX_PROBE_MATMUL_S:
                break
            bf16 = max(bf16, best_matmul_rate(torch.bfloat16, size, seconds))
    floor = CPU_FP32_FLOOR_PER_THREAD * torch.get_num_threads()
    return CpuSpeed(max(fp32, floor), bf16, torch.backends.cpu.get_cpu_capability(), _cpu_bf16_flags())


def _cpu_cache_key(kernel_env: str) -> str:
    return "|".join([socket.gethostname(), cpu_model(), torch.backends.cpu.get_cpu_capability(),
                     f"bf16flags={_cpu_bf16_flags()}", f"threads={torch.get_num_threads()}", torch.__version__,
                     kernel_env])


def cpu_speed(cache_file: Path | None = None, kernel_env: str = "", remeasure: bool = False) -> CpuSpeed:
    """This CPU's speed, from `cache_file` when this very machine and setting was measured before.

    kernel_env: settings that change which kernels run but not the CPU's identity (oneDNN's ISA
    limit), read by the launcher; part of the key.
    """
    key = _cpu_cache_key(kernel_env)
    cache: dict = {}
    if cache_file is not None and cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        if not isinstance(cache, dict):
            cache = {}
    entry = cache.get(key)
    speed = None
    if not remeasure and isinstance(entry, dict):
        try:
            speed = CpuSpeed(**entry)
        except TypeError:
            pass  # written by another version: measure again
    if speed is not None:
        # A peak measured while the machine was busy is too low and would overstate MFU for good:
        # every start takes one more short probe and the cache keeps the best rate seen.
        fp32 = max(speed.fp32_flops, best_matmul_rate(torch.float32, 1024, 0.2))
        bf16 = speed.bf16_flops
        if bf16 >= speed.fp32_flops:  # native bf16: its rate is a peak too (emulated, it is left alone)
            bf16 = max(bf16, best_matmul_rate(torch.bfloat16, 1024, 0.2))
        if (fp32, bf16) == (speed.fp32_flops, speed.bf16_flops):
            return speed
        speed = replace(speed, fp32_flops=fp32, bf16_flops=bf16)
    else:
        speed = measure_cpu_speed()
    if cache_file is not None:
        cache[key] = asdict(speed)
        write_json_cache(cache_file, cache)  # a read-only home only costs a probe per start
    return speed


def write_json_cache(path: Path, data: dict) -> None:
    """Write a measurement cache atomically (temp file + rename); an unwritable place is not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_whole(path, json.dumps(data, indent=1))
    except OSError:
        pass


@dataclass(frozen=True)
class LocalAccelerators:
    """The accelerators torch sees on this machine: what `optimus launch` gives each local rank one of."""

    device_type: str  # "cuda" (NVIDIA, or AMD under ROCm) or "xpu"
    name: str  # as torch reports the first one: "NVIDIA H100 80GB HBM3", "AMD Instinct MI250X", ...
    count: int
    memory_gib: float  # the first one's total memory


def local_accelerators() -> LocalAccelerators | None:
    """This machine's accelerators, of the kind launch.device_for gives local rank 0, or None: the CPU."""
    from optimus.parallel.launch import device_for

    device = device_for(0)
    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type)
    props = backend.get_device_properties(device)
    return LocalAccelerators(device.type, props.name, backend.device_count(), props.total_memory / 1024**3)


def accelerator_runtime_built() -> bool:
    """Whether this torch has a GPU (CUDA or ROCm) or XPU runtime: the CPU wheel has neither."""
    return torch.backends.cuda.is_built() or (hasattr(torch, "xpu") and torch.xpu._is_compiled())


def probe_local_accelerators(timeout_s: float = 120.0) -> LocalAccelerators | None:
    """local_accelerators() asked of a child process, so that this one (which goes on to launch jobs on those
    devices) opens no device context of its own, holding memory on device 0 for as long as it runs. A torch
    without an accelerator runtime sees none: no child (a second torch import) to ask."""
    if not accelerator_runtime_built():
        return None
    code = ("import dataclasses, json; from optimus.train.hardware import local_accelerators as f; "
            "a = f(); print(json.dumps(a and dataclasses.asdict(a)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise RuntimeError(f"asking torch for this machine's accelerators failed: {last}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return LocalAccelerators(**found) if found else None


def _accelerator_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "xpu":
        return torch.xpu.get_device_name(device)
    return device.type


def device_peak_flops(device: torch.device, dtype: str, cpu: CpuSpeed | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one device in the training dtype "fp32"/"bf16", where that figure comes from).

    On CPU the peak is the measured rate of the dtype, except for bf16 on a CPU that only emulates
    it: then the fp32 rate, the most this machine can do (MFU then shows what bf16 wastes).
    """
    if device.type == "cpu":
        cpu = cpu or cpu_speed()
        threads = torch.get_num_threads()
        if dtype == "bf16" and cpu.bf16_flops >= cpu.fp32_flops:
            return cpu.bf16_flops, f"measured CPU bf16 matmul, {threads} threads, {cpu.capability}"
        if dtype == "bf16":
            return cpu.fp32_flops, (f"measured CPU fp32 matmul, {threads} threads, {cpu.capability}: "
                                    f"bf16 is emulated here, {cpu.bf16_slowdown:.0f}x slower")
        return cpu.fp32_flops, f"measured CPU fp32 matmul, {threads} threads, {cpu.capability}"
    name = _accelerator_name(device)
    for fragment, bf16, fp32, source in DEVICE_PEAKS_TFLOPS:
        if fragment in name:
            return (bf16 if dtype == "bf16" else fp32) * 1e12, f"{source}: {name}, {dtype}"
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    measured = best_matmul_rate(torch_dtype, 8192, 1.0, device=device)
    return measured, f"measured {dtype} matmul on {name} (no datasheet entry)"
