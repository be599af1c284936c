"""Device peaks by SKU and dtype; the CPU's measured speed cached per machine and kernel setting."""

from __future__ import annotations

import json

import pytest
import torch

from optimus.parallel.launch import cpu_speed_cache
from optimus.train import hardware
from optimus.train.hardware import CpuSpeed, cpu_speed, device_peak_flops

AVX2_ONLY = CpuSpeed(fp32_flops=120e9, bf16_flops=0.9e9, capability="AVX2", bf16_flags=False)
NATIVE = CpuSpeed(fp32_flops=170e9, bf16_flops=400e9, capability="AVX512", bf16_flags=True)


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("AMD Instinct MI250X", "bf16", 191.5),
    ("AMD Instinct MI300X", "bf16", 1307.4),
    ("NVIDIA H100 NVL", "bf16", 835.0),
    ("NVIDIA H200 NVL", "bf16", 835.0),
    ("NVIDIA GH200 480GB", "bf16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),  # fp32 without TF32, as PyTorch runs it unless asked
    ("AMD Instinct MI300A", "bf16", 980.6),
    ("AMD Instinct MI250X", "fp32", 47.9),
])
def test_accelerator_peaks_come_from_the_datasheet_of_the_sku(monkeypatch, name, dtype, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, source = device_peak_flops(torch.device("cuda", 0), dtype)
    assert peak == pytest.approx(tflops * 1e12)
    assert "datasheet" in source and name in source and dtype in source


def test_a_specific_name_is_looked_up_before_any_name_it_contains():
    """First match wins: a fragment that contains an earlier one (GH200 contains H200) would never be reached."""
    fragments = [row[0] for row in hardware.DEVICE_PEAKS_TFLOPS]
    for later, fragment in enumerate(fragments):
        assert not any(earlier in fragment for earlier in fragments[:later]), fragment


def test_pvc_peak_is_per_tile(monkeypatch):
    monkeypatch.setattr(torch, "xpu", type("xpu", (), {"get_device_name": staticmethod(
        lambda device=None: "Intel(R) Data Center GPU Max 1550")}), raising=False)
    peak, source = device_peak_flops(torch.device("xpu", 0), "bf16")
    assert peak == pytest.approx(419.4e12) and "per tile" in source


def test_cpu_peak_is_the_measured_rate_of_the_dtype_and_fp32_where_bf16_is_emulated():
    assert device_peak_flops(torch.device("cpu"), "fp32", AVX2_ONLY)[0] == 120e9
    assert device_peak_flops(torch.device("cpu"), "bf16", NATIVE)[0] == 400e9
    peak, source = device_peak_flops(torch.device("cpu"), "bf16", AVX2_ONLY)
    assert peak == 120e9 and "emulated" in source and "133x slower" in source


def test_cpu_speed_is_measured_once_per_machine_and_kernel_setting(tmp_path, monkeypatch):
    calls = []

    def fake_measure():
        calls.append(1)
        return AVX2_ONLY

    monkeypatch.setattr(hardware, "measure_cpu_speed", fake_measure)
    monkeypatch.setattr(hardware, "best_matmul_rate", lambda *args, **kwargs: 1.0)  # the quick re-probe: slower
    cache = tmp_path / "cpu_speed.json"
    assert cpu_speed(cache, "") == AVX2_ONLY
    assert cpu_speed(cache, "") == AVX2_ONLY
    assert len(calls) == 1
    cpu_speed(cache, "ONEDNN_MAX_CPU_ISA=AVX2")  # another kernel setting is another entry
    assert len(calls) == 2
    keys = list(json.loads(cache.read_text()))
    assert len(keys) == 2 and all(torch.backends.cpu.get_cpu_capability() in key for key in keys)


def test_a_peak_cached_while_the_machine_was_busy_is_raised_by_a_later_probe(tmp_path, monkeypatch):
    busy = CpuSpeed(fp32_flops=20e9, bf16_flops=0.5e9, capability="AVX2", bf16_flags=False)
    monkeypatch.setattr(hardware, "measure_cpu_speed", lambda: busy)
    cache = tmp_path / "cpu_speed.json"
    cpu_speed(cache, "")
    monkeypatch.setattr(hardware, "best_matmul_rate", lambda *args, **kwargs: 110e9)
    assert cpu_speed(cache, "").fp32_flops == 110e9
    monkeypatch.setattr(hardware, "best_matmul_rate", lambda *args, **kwargs: 90e9)
    assert cpu_speed(cache, "").fp32_flops == 110e9  # the cache keeps the best rate seen


def test_a_damaged_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "measure_cpu_speed", lambda: AVX2_ONLY)
    cache = tmp_path / "cpu_speed.json"
    cache.write_text("[not a mapping")
    assert cpu_speed(cache, "") == AVX2_ONLY


def test_cache_location_and_kernel_settings_come_from_the_environment(tmp_path):
    path, kernel_env = cpu_speed_cache({"XDG_CACHE_HOME": str(tmp_path), "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert path == tmp_path / "optimus" / "cpu_speed.json" and kernel_env == "ONEDNN_MAX_CPU_ISA=AVX2"
    assert cpu_speed_cache({"HOME": str(tmp_path)})[1] == ""


def test_bf16_probe_never_grows_to_a_size_that_would_take_minutes(monkeypatch):
    """On a busy machine the 256 probes can misjudge emulated bf16 (~1 GFLOP/s) as native: the larger probes are
    then skipped, since one 2048 matmul at that rate would take seconds to minutes (it did, in CI-like runs)."""
    import torch

    from optimus.train import hardware

    sizes = []

    def fake_rate(dtype, size, seconds, device=None, min_repeats=3):
        sizes.append((dtype, size))
        return 2e9 if dtype == torch.float32 else 1.1e9  # fp32 slowed by load: bf16 looks "not much slower"

    monkeypatch.setattr(hardware, "best_matmul_rate", fake_rate)
    speed = hardware.measure_cpu_speed()
    assert (torch.bfloat16, 1024) not in sizes and (torch.bfloat16, 2048) not in sizes
    assert speed.bf16_flops == 1.1e9

    sizes.clear()  # native bf16 (fast): both larger probes run and the best rate counts
    monkeypatch.setattr(hardware, "best_matmul_rate",
                        lambda dtype, size, seconds, device=None, min_repeats=3: sizes.append((dtype, size)) or
                        (4e10 if size == 256 else 2e11))
    assert hardware.measure_cpu_speed().bf16_flops == 2e11
    assert (torch.bfloat16, 2048) in sizes


def test_a_cpu_whose_bf16_matches_fp32_reads_mfu_against_its_bf16_rate():
    even = CpuSpeed(fp32_flops=150e9, bf16_flops=150e9, capability="AVX512", bf16_flags=True)
    peak, source = device_peak_flops(torch.device("cpu"), "bf16", even)
    assert peak == 150e9 and source.startswith("measured CPU bf16 matmul") and "emulated" not in source


def test_a_cached_emulated_bf16_rate_is_not_probed_again(tmp_path, monkeypatch):
    """Each start re-probes the fp32 peak (one 1024 matmul); bf16 only where it is native: an emulated 1024 bf16
    matmul takes seconds, and its rate is no peak anyone reads."""
    monkeypatch.setattr(hardware, "measure_cpu_speed", lambda: AVX2_ONLY)
    cache = tmp_path / "cpu_speed.json"
    cpu_speed(cache, "")
    probed = []
    monkeypatch.setattr(hardware, "best_matmul_rate", lambda dtype, *args, **kwargs: probed.append(dtype) or 1.0)
    assert cpu_speed(cache, "") == AVX2_ONLY
    assert probed == [torch.float32]
    probed.clear()
    monkeypatch.setattr(hardware, "measure_cpu_speed", lambda: NATIVE)
    cpu_speed(cache, "", remeasure=True)
    cpu_speed(cache, "")
    assert probed == [torch.float32, torch.bfloat16]


def test_a_starved_fp32_probe_reads_as_the_floor_per_thread(monkeypatch):
    """A probe that met busy cores (here: 1 MFLOP/s) is raised to 1 GFLOP/s per thread, which any SIMD core beats."""
    monkeypatch.setattr(hardware, "best_matmul_rate", lambda *args, **kwargs: 1e6)
    speed = hardware.measure_cpu_speed()
    assert speed.fp32_flops == hardware.CPU_FP32_FLOOR_PER_THREAD * torch.get_num_threads()
    assert speed.bf16_flops == 1e6  # bf16 is not floored: an emulated rate is what it is
