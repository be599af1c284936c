"""Which implementation "auto" picks, and that the package never needs triton on CPU."""

import subprocess
import sys

import pytest
import torch

from optimus.ops import grouped_mm, permute_tokens, swiglu, unpermute_tokens
from optimus.ops.experts import _plan
from optimus.ops.grouped_mm import pick_gemm_backend


def test_auto_on_cpu_uses_blas_loop_and_block_chain():
    x, w = torch.zeros(4, 8), torch.zeros(2, 8, 8)
    assert pick_gemm_backend("auto", x, w).name == "loop"
    assert _plan("auto", x, w, torch.zeros(2, 4, 8)) is None
    assert _plan("torch", x, w, torch.zeros(2, 4, 8)) is None


@pytest.mark.parametrize("op", ["grouped_mm", "permute", "unpermute", "swiglu"])
def test_unknown_impl_is_rejected(op):
    calls = {
        "grouped_mm": lambda: grouped_mm(torch.zeros(2, 4), torch.zeros(1, 4, 4), torch.tensor([2]), impl="fast"),
        "permute": lambda: permute_tokens(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int64), 1, impl="fast"),
        "unpermute": lambda: unpermute_tokens(torch.zeros(2, 4), torch.arange(2), torch.ones(2, 1), impl="fast"),
        "swiglu": lambda: swiglu(torch.zeros(2, 4), impl="fast"),
    }
    with pytest.raises(ValueError, match="unknown impl"):
        calls[op]()


def test_cpu_paths_never_import_triton():
    script = """
import sys, torch
from optimus.ops import moe_experts_forward, grouped_mm, permute_tokens, unpermute_tokens, swiglu
from tests.helpers.ops import moe_inputs
inputs = moe_inputs(8, 8, 4, 4, 2)
moe_experts_forward(**inputs).sum().backward()
rows, order, counts = permute_tokens(inputs["x"], inputs["expert_ids"], 4)
unpermute_tokens(swiglu(grouped_mm(rows, inputs["w_gate_up"], counts)), order, inputs["weights"]).sum().backward()
assert "triton" not in sys.modules, "triton was imported"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
