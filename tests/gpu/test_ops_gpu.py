"""The expert kernels on a real GPU against the references: every impl the device can run
(auto, torch, triton, loop), fp32 and bf16, the same routing patterns as the CPU tests plus one
OLMoE-sized layer. Run with: pytest -m gpu tests/gpu"""

import pytest
import torch

from optimus.ops import permute_tokens, permute_tokens_reference
from optimus.ops._device import torch_grouped_mm_fast_on, triton_installed
from tests.helpers.ops import ROUTINGS, check_op_against_reference, moe_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU"),
]

DEVICE = "cuda"
DTYPES = [torch.float32, torch.bfloat16]
# GPU fp32 sums in a different order than the CPU; bf16 keeps the CPU tolerance
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: None}


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """The fp32 checks compare exact-ish math: no TF32 in torch's matmuls or in our Triton dots."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _needs(impl, dtype, grouped_mm_itself=False):
    if impl == "triton" and not triton_installed():
        pytest.skip("triton is not installed")
    # elsewhere impl="torch" falls back to a BLAS loop where torch._grouped_mm is not native
    if grouped_mm_itself and impl == "torch" and not torch_grouped_mm_fast_on(torch.device(DEVICE), dtype):
        pytest.skip("torch._grouped_mm is native only on CUDA sm90+ in bf16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["auto", "loop", "torch", "triton"])
@pytest.mark.parametrize("counts", [[50, 0, 170, 3, 0, 90], [0, 0, 333, 0]])
def test_grouped_mm(counts, impl, dtype):
    _needs(impl, dtype, grouped_mm_itself=True)
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor(counts, device=DEVICE)
    inputs = {
        "x": torch.randn(int(counts.sum()), 256, generator=gen).to(DEVICE, dtype).requires_grad_(),
        "w": (torch.randn(len(counts), 256, 384, generator=gen) / 16).to(DEVICE, dtype).requires_grad_(),
        "counts": counts,
    }
    check_op_against_reference("grouped_mm", impl, inputs, dtype, impl, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["auto", "torch", "triton"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_moe_experts(top_k, routing, impl, dtype):
    _needs(impl, dtype)
    inputs = moe_inputs(300, 128, 96, 16, top_k, routing, dtype, device=DEVICE)
    check_op_against_reference("moe_experts", impl, inputs, dtype, f"{impl}/{routing}", TOLERANCE[dtype])


@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_moe_experts_olmoe_layer_bf16(impl):
    _needs(impl, torch.bfloat16)
    inputs = moe_inputs(2048, 2048, 1024, 64, 8, "skewed", torch.bfloat16, device=DEVICE)
    check_op_against_reference("moe_experts", impl, inputs, torch.bfloat16, impl)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["auto", "torch", "triton"])
def test_expert_mlp(impl, dtype):
    _needs(impl, dtype)
    gen = torch.Generator().manual_seed(2)
    counts = torch.tensor([70, 0, 120, 1], device=DEVICE)
    inputs = {
        "rows": torch.randn(191, 64, generator=gen).to(DEVICE, dtype).requires_grad_(),
        "w_gate_up": (torch.randn(4, 64, 96, generator=gen) / 8).to(DEVICE, dtype).requires_grad_(),
        "w_down": (torch.randn(4, 48, 64, generator=gen) / 7).to(DEVICE, dtype).requires_grad_(),
        "counts": counts,
    }
    check_op_against_reference("expert_mlp", impl, inputs, dtype, impl, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["auto", "torch", "triton"])
def test_permute_unpermute_swiglu(impl, dtype):
    _needs(impl, dtype)
    inputs = moe_inputs(257, 96, 8, 12, 4, "skewed", dtype, device=DEVICE)
    rows, order, counts = permute_tokens(inputs["x"], inputs["expert_ids"], 12, impl=impl)
    ref_rows, ref_order, ref_counts = permute_tokens_reference(inputs["x"], inputs["expert_ids"], 12)
    assert torch.equal(rows, ref_rows) and torch.equal(order, ref_order) and torch.equal(counts, ref_counts)
    unpermute_inputs = {"rows": ref_rows.detach().requires_grad_(), "order": order, "weights": inputs["weights"]}
    check_op_against_reference("unpermute_tokens", impl, unpermute_inputs, dtype, "unpermute", TOLERANCE[dtype])
    gate_up = {"gate_up": (torch.randn(300, 2 * 80) * 3).to(DEVICE, dtype).requires_grad_()}
    check_op_against_reference("swiglu", impl, gate_up, dtype, "swiglu", TOLERANCE[dtype])
