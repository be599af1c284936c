"""The fused expert path (CPU block chain, and the whole-tensor path with torch primitives)
against the chain of reference ops: outputs and gradients of x, router weights, both weights."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optimus.ops import cpu_experts, expert_mlp, expert_mlp_reference, moe_experts_forward, moe_experts_reference
from optimus.ops.experts import _FusedExperts
from optimus.ops.grouped_mm import BACKENDS
from optimus.ops.routing import Routing
from tests.helpers.dispatch import OpCounter
from tests.helpers.ops import ROUTINGS, check_against_reference, moe_inputs

GRADS = ("x", "weights", "w_gate_up", "w_down")
# (tokens, d_model, ffn, experts, top_k): odd sizes on purpose
SHAPES = {"top1": (21, 12, 10, 4, 1), "top2": (17, 20, 6, 6, 2), "top8": (9, 16, 8, 16, 8)}


@pytest.fixture(params=["5_row_chunks", "one_chunk"])
def chunking(request, monkeypatch):
    """Chunks of 5 rows cut experts (an expert spans chunks, its weight gradient accumulates);
    one chunk holds every expert."""
    if request.param == "5_row_chunks":
        monkeypatch.setattr(cpu_experts, "CHUNK_BYTES", 1)
        monkeypatch.setattr(cpu_experts, "MIN_CHUNK_ROWS", 5)


def _whole_tensor_torch(x, expert_ids, weights, w_gate_up, w_down):
    # the accelerator path without Triton, run on CPU
    routing = Routing.from_expert_ids(expert_ids, w_gate_up.shape[0])
    return _FusedExperts.apply(x, w_gate_up, w_down, weights, routing, routing.groups, BACKENDS["loop"], "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_moe_experts_match_reference(shape, routing, dtype, chunking):
    if routing == "empty_experts" and shape == "top8":
        routing = "skewed"  # 8 of 16 experts cannot leave half of them empty
    inputs = moe_inputs(*SHAPES[shape], routing=routing, dtype=dtype)
    check_against_reference(moe_experts_forward, moe_experts_reference, inputs, GRADS, dtype, f"{shape}/{routing}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["uniform", "one_expert", "empty_experts"])
def test_whole_tensor_path_matches_reference(routing, dtype):
    inputs = moe_inputs(*SHAPES["top2"], routing=routing, dtype=dtype)
    check_against_reference(_whole_tensor_torch, moe_experts_reference, inputs, GRADS, dtype, routing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_chunking_matches_reference(dtype):
    inputs = moe_inputs(*SHAPES["top8"], routing="skewed", dtype=dtype)
    check_against_reference(moe_experts_forward, moe_experts_reference, inputs, GRADS, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_tokens_on_one_expert_top1(dtype, chunking):
    inputs = moe_inputs(23, 8, 6, 5, 1, routing="one_expert", dtype=dtype)
    assert inputs["expert_ids"].unique().numel() == 1
    check_against_reference(moe_experts_forward, moe_experts_reference, inputs, GRADS, dtype)


@pytest.mark.parametrize("impl", ["auto", "whole_tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_mlp_matches_reference(dtype, impl, chunking):
    gen = torch.Generator().manual_seed(2)
    counts = torch.tensor([7, 0, 12, 1])
    inputs = {
        "rows": torch.randn(20, 10, generator=gen).to(dtype).requires_grad_(),
        "w_gate_up": (torch.randn(4, 10, 12, generator=gen) * 0.3).to(dtype).requires_grad_(),
        "w_down": (torch.randn(4, 6, 10, generator=gen) * 0.4).to(dtype).requires_grad_(),
        "counts": counts,
    }
    if impl == "auto":
        fast = expert_mlp
    else:
        def fast(rows, w_gate_up, w_down, counts):
            from optimus.ops.routing import Groups

            return _FusedExperts.apply(rows, w_gate_up, w_down, None, None, Groups(counts), BACKENDS["loop"], "torch")
    check_against_reference(fast, expert_mlp_reference, inputs, ("rows", "w_gate_up", "w_down"), dtype)


def test_chunks_cut_experts_into_pieces():
    from optimus.ops.routing import Groups

    chunks = list(cpu_experts.plan_chunks(Groups(torch.tensor([3, 0, 6, 1])), 10, 4))
    assert chunks == [
        (0, 4, [(0, 0, 3, True), (2, 3, 4, True)]),
        (4, 8, [(2, 0, 4, False)]),
        (8, 10, [(2, 0, 1, False), (3, 1, 2, True)]),
    ]


def test_reference_impl_is_the_reference():
    inputs = moe_inputs(*SHAPES["top2"])
    a = moe_experts_forward(**inputs, impl="reference")
    b = moe_experts_reference(**inputs)
    assert torch.equal(a, b)


@pytest.mark.parametrize("chunked", [False, True])
def test_saves_only_input_and_gate_up_output(chunked, monkeypatch):
    if chunked:
        monkeypatch.setattr(cpu_experts, "CHUNK_BYTES", 1)
        monkeypatch.setattr(cpu_experts, "MIN_CHUNK_ROWS", 5)
    inputs = moe_inputs(16, 8, 6, 4, 2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        moe_experts_forward(**inputs)
    parameters = [inputs[name] for name in ("x", "weights", "w_gate_up", "w_down")]
    activations = [t for t in saved if not any(t is p for p in parameters) and t.is_floating_point()]
    # besides the inputs and the routing (sort order [T*k] and counts [E], int64), the gate_up output
    # [T*k, 2F] and nothing else: no gathered rows, no activation, no down output
    routing = [t for t in saved if not t.is_floating_point()]
    assert sorted(t.numel() for t in routing) == [4, 32]
    assert any(t is inputs["x"] for t in saved)
    assert {t.shape[1] for t in activations} == {12} and sum(t.shape[0] for t in activations) == 32


@pytest.mark.parametrize("op", ["moe_experts", "expert_mlp"])
def test_backward_builds_no_zero_gradient_for_gate_up(op):
    """gate_up is the op's output only so that backward can reuse it; autograd must not zero-fill a [T k, 2F]
    "gradient" for it each layer and step."""
    inputs = moe_inputs(16, 8, 6, 4, 2)
    if op == "moe_experts":
        out = moe_experts_forward(**inputs)
    else:
        out = expert_mlp(inputs["x"][:12], inputs["w_gate_up"], inputs["w_down"], torch.tensor([5, 0, 4, 3]))
    with OpCounter() as counted:
        out.sum().backward()
    assert counted.calls["aten.zeros.default"] == 0, counted.calls


def test_backward_twice_fails_loudly():
    # backward writes the gate_up gradient over the saved gate_up output
    inputs = moe_inputs(8, 8, 4, 4, 2)
    out = moe_experts_forward(**inputs)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_autocast_runs_in_bf16():
    inputs = moe_inputs(8, 8, 4, 4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe_experts_forward(**inputs)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert inputs["w_gate_up"].grad.dtype == torch.float32


def test_rejects_mismatched_shapes():
    inputs = moe_inputs(8, 8, 4, 4, 2)
    with pytest.raises(ValueError, match="expert shapes disagree"):
        moe_experts_forward(inputs["x"], inputs["expert_ids"], inputs["weights"], inputs["w_gate_up"], inputs["w_gate_up"])


class _MatmulShapes(TorchDispatchMode):
    """The operand shapes of every matrix product dispatched inside."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm_.default):
            self.shapes.add(tuple(d for a in args if isinstance(a, torch.Tensor) for d in a.shape))
        return func(*args, **(kwargs or {}))


def _cpu_chain(inputs):
    routing = Routing.from_expert_ids(inputs["expert_ids"], inputs["w_gate_up"].shape[0])
    out = cpu_experts.CpuExpertMLP.apply(inputs["x"], inputs["w_gate_up"], inputs["w_down"], inputs["weights"],
                                         routing)
    out.float().pow(2).sum().backward()
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reduced_precision_gemms_run_rounded_rows(dtype, chunking):
    """bf16 products run over rows rounded to 16 (oneDNN builds a kernel per shape; the counts change every step),
    forward and backward; fp32 ones (MKL) over the exact rows. D, F and 2F are multiples of 16 here, so every
    dimension of a bf16 product is one."""
    with _MatmulShapes() as seen:
        for seed in range(3):
            _cpu_chain(moe_inputs(37, 32, 48, 4, 2, routing="skewed", dtype=dtype, seed=seed))
    assert len(seen.shapes) > 4
    odd = {shape for shape in seen.shapes if any(d % 16 for d in shape)}
    assert (not odd) if dtype == torch.bfloat16 else odd


def test_rounded_rows_change_no_result(chunking, monkeypatch):
    """The rounded bf16 products give what the exact ones give: outputs and every gradient."""
    results = []
    for kernel_per_shape in (cpu_experts._KERNEL_PER_SHAPE, ()):
        monkeypatch.setattr(cpu_experts, "_KERNEL_PER_SHAPE", kernel_per_shape)
        inputs = moe_inputs(37, 32, 48, 4, 2, routing="skewed", dtype=torch.bfloat16, seed=1)
        out = _cpu_chain(inputs)
        results.append([out] + [inputs[name].grad for name in GRADS])
    for rounded, exact in zip(*results):
        torch.testing.assert_close(rounded, exact, rtol=0, atol=0)


def test_rounded_rows_add_at_most_a_thirty_second_of_the_count():
    """bf16 expert GEMMs run over rows rounded up to a multiple of 16, and of 1/64 to 1/32 of the count when that is
    larger: at most ~3% more expert FLOPs (cpu_experts' docstring). fp32 runs the exact rows."""
    for rows in range(1, 20_000):
        rounded = cpu_experts.gemm_rows(rows, torch.bfloat16)
        assert rounded % 16 == 0 and rows <= rounded < rows + max(16, rows / 32), rows
    assert cpu_experts.gemm_rows(1000, torch.float32) == 1000
