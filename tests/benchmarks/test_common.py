"""How the benchmarks pick their dtypes, on a CPU that computes bf16 natively and on one that only
emulates it (the measured speeds are given, not probed); how a benchmark script ends when its reader goes away."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from optimus.train.hardware import CpuSpeed
from tests.benchmarks.conftest import BENCHMARKS

AVX2_ONLY = CpuSpeed(fp32_flops=9e10, bf16_flops=7e8, capability="AVX2", bf16_flags=False)
AMX = CpuSpeed(fp32_flops=2e11, bf16_flops=8e11, capability="AVX512", bf16_flags=True)


@pytest.fixture
def common(load_benchmark):
    return load_benchmark("_common")


def with_cpu(monkeypatch, common, speed: CpuSpeed):
    monkeypatch.setattr(common, "cpu_speed", lambda *args, **kwargs: speed)


def test_auto_compares_bf16_only_where_native(monkeypatch, common):
    cpu = torch.device("cpu")
    with_cpu(monkeypatch, common, AVX2_ONLY)
    [only] = common.dtypes_to_compare("auto", cpu)
    assert (only.dtype, only.requested, only.warning) == ("fp32", "auto", None)
    assert "no native bf16" in only.reason
    with_cpu(monkeypatch, common, AMX)
    assert [(p.dtype, p.requested, p.warning) for p in common.dtypes_to_compare("auto", cpu)] == [
        ("fp32", "auto", None), ("bf16", "auto", None)]


def test_explicit_emulated_bf16_runs_with_the_warning(monkeypatch, capsys, common):
    with_cpu(monkeypatch, common, AVX2_ONLY)
    fp32, bf16 = common.dtypes_to_compare("fp32,bf16", torch.device("cpu"))
    assert (fp32.dtype, fp32.warning) == ("fp32", None)
    assert bf16.dtype == "bf16" and "about 129x slower" in bf16.warning
    assert common.emulated_bf16(bf16) and not common.emulated_bf16(fp32)
    line = common.announce(bf16)
    out, err = capsys.readouterr()
    assert out.strip() == line and line.startswith("dtype bf16 (--dtype bf16: ")
    assert err.strip() == bf16.warning
    assert common.precision_fields(bf16) == {"dtype": "bf16", "dtype_requested": "bf16", "dtype_reason": bf16.reason}


def test_native_explicit_bf16_has_no_warning(monkeypatch, common):
    with_cpu(monkeypatch, common, AMX)
    [bf16] = common.dtypes_to_compare("bf16", torch.device("cpu"))
    assert bf16.dtype == "bf16" and bf16.warning is None and not common.emulated_bf16(bf16)


@pytest.mark.parametrize("text", ["fp16", "auto,bf16", "fp32,fp32", ""])
def test_dtype_list_rejects_what_it_cannot_run(common, text):
    with pytest.raises(argparse.ArgumentTypeError):
        common.dtype_list(text)
    assert common.dtype_list("bf16,fp32") == "bf16,fp32"


def test_prediction_accuracy_is_the_mean_and_largest_absolute_error(common):
    line = common.prediction_accuracy([0.10, -0.20, 0.0, 0.06])
    assert line.startswith("step time: mean absolute error 9.0%, largest 20.0% over 4")
    assert "vTrain 8.37%" in line  # beside the published predictors (REFERENCE.md)
    assert common.prediction_accuracy([]) == "no step times compared"


def test_a_table_piped_to_head_ends_quietly_with_141(tmp_path):
    """`python benchmarks/plan_here_stored.py | head`: the script stops writing once head has gone, no traceback."""
    script = tmp_path / "long_table.py"
    script.write_text(f"import sys\nsys.path[:0] = [{str(BENCHMARKS)!r}, {str(BENCHMARKS.parent)!r}]\n"
                      "from _common import run_script\n"
                      "def main():\n    for row in range(200_000):\n        print(f'row {row}')\n    return 0\n"
                      "run_script(main)\n")
    # 200,000 rows outgrow the pipe's buffer: the script is still writing when head has gone
    done = subprocess.run(["bash", "-c", f"{sys.executable} {script} | head -1; exit ${{PIPESTATUS[0]}}"],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (141, "row 0\n") and done.stderr == "", done.stderr
