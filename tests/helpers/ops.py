"""Random inputs, tolerances and checks of the ops against their references.

Shared by the unit tests (CPU, and Triton's interpreter), the GPU tests and the benchmarks, so
that all of them exercise the same routing patterns.
"""

from __future__ import annotations

from functools import partial

import torch

from optimus.ops import (
    expert_mlp,
    expert_mlp_reference,
    grouped_mm,
    grouped_mm_reference,
    moe_experts_forward,
    moe_experts_reference,
    swiglu,
    swiglu_reference,
    unpermute_tokens,
    unpermute_tokens_reference,
)

# Routing patterns that break kernels in different ways.
ROUTINGS = ("uniform", "skewed", "one_expert", "empty_experts")

# Relative to the largest magnitude of the expected tensor. fp32 agrees to rounding; bf16 differs
# by where the (8-bit mantissa) roundings happen, e.g. fused kernels round once, autograd chains
# round after every op.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def route(n_tokens: int, top_k: int, n_experts: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """[n_tokens, top_k] distinct expert ids per token, following one of ROUTINGS."""
    if kind == "uniform":
        scores = torch.rand(n_tokens, n_experts, generator=generator)
    elif kind == "skewed":
        # most tokens prefer the first experts; the last ones stay nearly idle
        bias = torch.linspace(4.0, 0.0, n_experts)
        scores = torch.rand(n_tokens, n_experts, generator=generator) + bias
    elif kind == "one_expert":
        # every token's first choice is the same expert
        scores = torch.rand(n_tokens, n_experts, generator=generator)
        scores[:, n_experts // 2] = 10.0
    elif kind == "empty_experts":
        # only the even experts are ever chosen
        scores = torch.rand(n_tokens, n_experts, generator=generator)
        scores[:, 1::2] = -1.0
        if top_k > (n_experts + 1) // 2:
            raise ValueError("empty_experts needs top_k <= half the experts")
    else:
        raise ValueError(f"unknown routing '{kind}': choose one of {ROUTINGS}")
    return scores.topk(top_k, dim=-1).indices


def moe_inputs(
    n_tokens: int,
    d_model: int,
    ffn: int,
    n_experts: int,
    top_k: int,
    routing: str = "uniform",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """x, expert_ids, weights, w_gate_up [E, D, 2F], w_down [E, F, D] with leaf grads enabled.

    Weights are scaled like a trained layer's (unit-variance activations), so that bf16 errors
    are measured on values of sensible size.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = route(n_tokens, top_k, n_experts, routing, gen)
    probs = torch.rand(n_tokens, top_k, generator=gen) + 0.1

    def leaf(*shape, scale=1.0, leaf_dtype=dtype):
        value = torch.randn(*shape, generator=gen) * scale
        return value.to(device=device, dtype=leaf_dtype).requires_grad_()

    return {
        "x": leaf(n_tokens, d_model),
        "expert_ids": ids.to(device),
        "weights": (probs / probs.sum(-1, keepdim=True)).to(device).requires_grad_(),
        "w_gate_up": leaf(n_experts, d_model, 2 * ffn, scale=d_model**-0.5),
        "w_down": leaf(n_experts, ffn, d_model, scale=ffn**-0.5),
    }


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 for empty tensors)."""
    if expected.numel() == 0:
        return 0.0
    scale = expected.detach().float().abs().max().clamp_min(1e-12)
    return ((actual.detach().float() - expected.detach().float()).abs().max() / scale).item()


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "", tolerance: float | None = None
) -> None:
    """Raise AssertionError when shapes differ or the relative error exceeds the tolerance
    (TOLERANCE[dtype] unless given)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    limit = TOLERANCE[dtype] if tolerance is None else tolerance
    error = relative_error(actual, expected)
    if not error <= limit:
        raise AssertionError(f"{what}: relative error {error:.2e} > {limit:.0e} ({dtype})")


def outputs_and_grads(fn, inputs: dict[str, torch.Tensor], names: tuple[str, ...], seed: int = 1) -> list[torch.Tensor]:
    """[fn(**inputs), d/d inputs[name] for name in names] for a fixed random output gradient."""
    out = fn(**inputs)
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, [inputs[name] for name in names], grad, allow_unused=True)
    return [out] + [g if g is not None else torch.zeros_like(inputs[n]) for g, n in zip(grads, names)]


def as_fp32_leaves(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values in fp32, as fresh leaves (integer tensors are passed through)."""
    return {
        name: value.detach().float().requires_grad_(value.requires_grad) if value.is_floating_point() else value
        for name, value in inputs.items()
    }


def check_against_reference(fast, reference, inputs, grad_names, dtype, what="", tolerance=None) -> None:
    """Outputs and gradients of fast(**inputs) match reference(**fp32 copies of inputs).

    bf16 results are thus checked against the fp32 reference run on the same (bf16-rounded)
    inputs, so the tolerance measures only the fast op's own rounding. Gradients must come back
    in their input's dtype.
    """
    actual = outputs_and_grads(fast, inputs, grad_names)
    expected = outputs_and_grads(reference, as_fp32_leaves(inputs), grad_names)
    for name, got, want in zip(("output",) + tuple(grad_names), actual, expected):
        if name != "output" and got.dtype != inputs[name].dtype:
            raise AssertionError(f"{what}: grad of {name} is {got.dtype}, its input {inputs[name].dtype}")
        assert_close(got, want, dtype, f"{what} {name}", tolerance)


# Each op with an `impl` choice, by name: the op, its reference, and the inputs whose gradients are compared.
OPS_AND_REFERENCES = {
    "grouped_mm": (grouped_mm, grouped_mm_reference, ("x", "w")),
    "moe_experts": (moe_experts_forward, moe_experts_reference, ("x", "weights", "w_gate_up", "w_down")),
    "expert_mlp": (expert_mlp, expert_mlp_reference, ("rows", "w_gate_up", "w_down")),
    "unpermute_tokens": (unpermute_tokens, unpermute_tokens_reference, ("rows", "weights")),
    "swiglu": (swiglu, swiglu_reference, ("gate_up",)),
}


def check_op_against_reference(op_name, impl, inputs, dtype, what="", tolerance=None) -> None:
    """The op named op_name, run with impl=impl, matches its reference (see check_against_reference)."""
    op, reference, grad_names = OPS_AND_REFERENCES[op_name]
    check_against_reference(partial(op, impl=impl), reference, inputs, grad_names, dtype, what, tolerance)


def experts_saved_bytes(experts: torch.nn.Module, tokens: int, d_model: int, top_k: int, n_experts: int) -> int:
    """Bytes autograd saves (parameters aside) for one forward and backward of an experts module (parallel or
    not) given `tokens` tokens whose copies go to every expert alike (copy j to expert j mod n_experts)."""
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
              for p in experts.parameters()}
    x = torch.randn(tokens, d_model, requires_grad=True)
    expert_ids = (torch.arange(tokens * top_k) % n_experts).view(tokens, top_k)
    weights = torch.full((tokens, top_k), 1.0 / top_k, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        experts(x, expert_ids, weights).sum().backward()
    return sum(storages.values())
