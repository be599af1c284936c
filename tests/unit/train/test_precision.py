"""train.dtype=auto: bf16 only where the device computes it natively; an explicit bf16 elsewhere warns."""

from __future__ import annotations

import pytest
import torch

from optimus.train import precision as precision_module
from optimus.train.hardware import CpuSpeed, best_matmul_rate, cpu_speed
from optimus.train.precision import choose_precision, native_bf16

CPU = torch.device("cpu")
AVX2_ONLY = CpuSpeed(fp32_flops=120e9, bf16_flops=0.9e9, capability="AVX2", bf16_flags=False)
SAPPHIRE_RAPIDS = CpuSpeed(fp32_flops=170e9, bf16_flops=400e9, capability="AVX512", bf16_flags=True)
# flags say bf16 but oneDNN was capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2): the probe shows the truth
FLAGS_BUT_CAPPED = CpuSpeed(fp32_flops=58e9, bf16_flags=True, bf16_flops=0.9e9, capability="AVX2")


def test_auto_is_fp32_on_a_cpu_without_native_bf16():
    chosen = choose_precision("auto", CPU, AVX2_ONLY)
    assert chosen.dtype == "fp32" and chosen.warning is None
    assert "no native bf16" in chosen.reason and "AVX2" in chosen.reason
    assert chosen.describe().startswith("precision: fp32 (train.dtype=auto; ")


def test_auto_is_bf16_on_a_cpu_with_fast_native_bf16():
    chosen = choose_precision("auto", CPU, SAPPHIRE_RAPIDS)
    assert chosen.dtype == "bf16" and chosen.warning is None


def test_flags_alone_do_not_make_bf16_native_when_the_probe_says_it_is_slow():
    assert native_bf16(CPU, FLAGS_BUT_CAPPED)[0] is False
    assert choose_precision("auto", CPU, FLAGS_BUT_CAPPED).dtype == "fp32"


def test_explicit_bf16_without_native_support_runs_with_one_warning_stating_the_slowdown():
    chosen = choose_precision("bf16", CPU, AVX2_ONLY)
    assert chosen.dtype == "bf16"
    assert chosen.warning is not None and "\n" not in chosen.warning
    assert "133x slower than fp32" in chosen.warning and "train.dtype=auto" in chosen.warning


def test_explicit_fp32_is_kept_everywhere():
    assert choose_precision("fp32", CPU, SAPPHIRE_RAPIDS).dtype == "fp32"


@pytest.mark.parametrize("capability, expected", [((7, 0), "fp32"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_cuda_bf16_follows_compute_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(precision_module.torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    chosen = choose_precision("auto", torch.device("cuda", 0))
    assert chosen.dtype == expected and f"compute capability {capability[0]}.{capability[1]}" in chosen.reason


@pytest.mark.parametrize("arch, expected", [("gfx908", "fp32"), ("gfx90a:sramecc+:xnack-", "bf16"), ("gfx942", "bf16")])
def test_rocm_bf16_from_mi200_on(monkeypatch, arch, expected):
    class Properties:
        gcnArchName = arch

    monkeypatch.setattr(precision_module.torch.version, "hip", "6.2")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "AMD Instinct")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Properties())
    assert choose_precision("auto", torch.device("cuda", 0)).dtype == expected


def test_the_probe_on_this_cpu_agrees_with_its_measured_rates():
    """Whatever CPU this runs on: auto is bf16 exactly when bf16 matmuls are not slower than fp32."""
    speed = cpu_speed(cache_file=None)
    chosen = choose_precision("auto", CPU, speed)
    assert chosen.dtype == ("bf16" if speed.bf16_flags and speed.bf16_flops >= speed.fp32_flops else "fp32")
    assert speed.fp32_flops >= 1e9 * torch.get_num_threads()  # the sanity floor
    assert best_matmul_rate(torch.float32, 64, 0.0, min_repeats=1) > 0


def test_bf16_as_fast_as_fp32_counts_as_native():
    """"Not slower than fp32": a CPU with the bf16 units whose bf16 matmul rate equals its fp32 rate trains in bf16."""
    even = CpuSpeed(fp32_flops=150e9, bf16_flops=150e9, capability="AVX512", bf16_flags=True)
    assert native_bf16(CPU, even)[0] is True
    assert choose_precision("auto", CPU, even).dtype == "bf16"
