"""The expert half of a dropless MoE layer as one differentiable op.

    moe_experts_forward(x, expert_ids, weights, w_gate_up, w_down)
        = unpermute(grouped_mm(swiglu(grouped_mm(permute(x), w_gate_up)), w_down), weights)

Fused, it keeps fewer activations and makes fewer passes over memory than the chain of
separate ops: the router weight is applied inside a pass that exists anyway (the SwiGLU kernel
on accelerators, the combine on CPU) and its gradient comes out of one F-wide dot product; only
x and the gate_up output are saved (backward re-gathers the rows and recomputes the
activation); the gate_up gradient overwrites the saved gate_up output. On CPU the chain runs
chunk by chunk over the sorted rows (ops/cpu_experts.py); on accelerators it runs whole-tensor,
with Triton kernels for the row work and the device's best grouped GEMM.

Backward may run once per forward (it reuses saved memory): a second backward through the same
graph raises PyTorch's "modified by an inplace operation" error instead of giving wrong grads.

Both entry points are torch.library ops (optimus::moe_experts, optimus::expert_mlp, each with a
backward op, fake implementations and registered autograd): FakeTensor (the fake-device check, the
dry run) and torch.compile see one op each, and the routing's host reads stay inside it.
"""

from __future__ import annotations

import torch

from optimus.ops._device import (
    check_impl,
    compute_dtype,
    torch_grouped_mm_accepts,
    torch_grouped_mm_fast_on,
    triton_runs_on,
)
from optimus.ops.cpu_experts import CpuExpertMLP, chunk_rows
from optimus.ops.grouped_mm import BACKENDS, GemmBackend, grouped_mm_reference, pick_gemm_backend
from optimus.ops.permute import (
    combine_rows,
    gather_rows,
    permute_tokens_reference,
    unpermute_tokens_reference,
)
from optimus.ops.routing import Groups, Routing
from optimus.ops.swiglu import swiglu_backward, swiglu_forward, swiglu_reference


def expert_mlp_reference(rows, w_gate_up, w_down, counts):
    """Ground truth for expert_mlp: reference grouped GEMMs and SwiGLU with plain autograd."""
    hidden = swiglu_reference(grouped_mm_reference(rows, w_gate_up, counts))
    return grouped_mm_reference(hidden, w_down, counts)


def moe_experts_reference(x, expert_ids, weights, w_gate_up, w_down):
    """Ground truth for moe_experts_forward: the chain of reference ops."""
    rows, order, counts = permute_tokens_reference(x, expert_ids, w_gate_up.shape[0])
    return unpermute_tokens_reference(expert_mlp_reference(rows, w_gate_up, w_down, counts), order, weights)


class _FusedExperts(torch.autograd.Function):
    """Whole-tensor fused expert MLP. With a routing it gathers token copies from x and combines
    the weighted outputs per token ([T, D]); without, x holds the sorted rows ([M, D] out)."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, weights, routing, groups, gemm, row_backend):
        row_weights = weights.reshape(-1)[routing.order] if weights is not None else None
        rows = gather_rows(x, routing.order, routing.top_k, row_backend) if routing is not None else x
        h = gemm.rows(rows, w_gate_up, groups)
        del rows
        act = swiglu_forward(h, row_weights, row_backend)
        out = gemm.rows(act, w_down, groups)
        del act
        if routing is not None:
            out = combine_rows(out, routing.row_of_slot, None, row_backend)
        ctx.save_for_backward(x, w_gate_up, w_down, row_weights, h)
        ctx.routing, ctx.groups, ctx.gemm, ctx.row_backend = routing, groups, gemm, row_backend
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate_up, w_down, row_weights, h = ctx.saved_tensors
        routing, groups, gemm, backend = ctx.routing, ctx.groups, ctx.gemm, ctx.row_backend
        grad_out = grad_out.contiguous()
        grad_y = gather_rows(grad_out, routing.order, routing.top_k, backend) if routing is not None else grad_out
        act = swiglu_forward(h, row_weights, backend)
        grad_w_down = gemm.wgrad(act, grad_y, groups)
        del act
        grad_act = gemm.rows(grad_y, w_down.transpose(1, 2), groups)
        del grad_y
        grad_h, grad_row_weights = swiglu_backward(h, grad_act, row_weights, backend, in_place=True)
        del grad_act
        rows = gather_rows(x, routing.order, routing.top_k, backend) if routing is not None else x
        grad_w_gate_up = gemm.wgrad(rows, grad_h, groups)
        del rows
        grad_rows = gemm.rows(grad_h, w_gate_up.transpose(1, 2), groups)
        grad_x = combine_rows(grad_rows, routing.row_of_slot, None, backend) if routing is not None else grad_rows
        grad_weights = None
        if grad_row_weights is not None:
            grad_weights = grad_row_weights[routing.row_of_slot]
        return grad_x, grad_w_gate_up, grad_w_down, grad_weights, None, None, None, None


def _plan(impl: str, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[GemmBackend, str] | None:
    """(grouped GEMM backend, row-kernel backend) for the whole-tensor path; None = the CPU path."""
    if impl == "triton":
        return BACKENDS["triton"], "triton"
    if x.device.type == "cpu":
        return None
    if impl == "torch":
        native = torch_grouped_mm_fast_on(x.device, x.dtype) and torch_grouped_mm_accepts(x, w_gate_up, w_down)
        return BACKENDS["torch" if native else "loop"], "torch"
    gemm = pick_gemm_backend("auto", x, w_gate_up)
    return gemm, "triton" if triton_runs_on(x.device) else "torch"


def _validate(x, w_gate_up, w_down):
    n_experts, d_model, two_ffn = w_gate_up.shape
    if x.shape[-1] != d_model or two_ffn % 2 or w_down.shape != (n_experts, two_ffn // 2, d_model):
        raise ValueError(
            f"expert shapes disagree: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)} (want [E, D, 2F]), "
            f"w_down {tuple(w_down.shape)} (want [E, F, D])"
        )


def expert_mlp(
    rows: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, counts: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """SwiGLU expert MLP over expert-sorted rows: grouped_mm(swiglu(grouped_mm(rows, w_gate_up)), w_down).

    rows: [M, D] sorted by expert; w_gate_up: [E, D, 2F] (gate columns first); w_down: [E, F, D];
    counts: [E] rows per expert (sum M, zeros allowed) -> [M, D]. Differentiable in rows and
    both weights. impl: "auto", "reference", "torch" or "triton".
    """
    check_impl(impl)
    _validate(rows, w_gate_up, w_down)
    dtype = compute_dtype(rows, w_gate_up)
    rows, w_gate_up, w_down = rows.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)
    if impl == "reference":
        return expert_mlp_reference(rows, w_gate_up, w_down, counts)
    return torch.ops.optimus.expert_mlp(rows, w_gate_up, w_down, counts, impl)[0]


def moe_experts_forward(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    impl: str = "auto",
) -> torch.Tensor:
    """The routed experts of a dropless MoE layer: permute, expert MLP, weighted combine, fused.

    x: [T, D] tokens; expert_ids: [T, k] chosen experts (int64); weights: [T, k] router weights
    (any float dtype, not renormalised here); w_gate_up: [E, D, 2F]; w_down: [E, F, D] -> [T, D],
    out[t] = sum_s weights[t, s] * MLP_{expert_ids[t, s]}(x[t]). Differentiable in x, weights and
    both expert weights. impl: "auto" (fastest for the device), "reference" (pure-torch ops),
    "torch" (no Triton), "triton". Under autocast the expert math runs in the autocast dtype.
    """
    check_impl(impl)
    _validate(x, w_gate_up, w_down)
    if expert_ids.shape != weights.shape or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids {tuple(expert_ids.shape)} and weights {tuple(weights.shape)} must both be [T, k]")
    dtype = compute_dtype(x, w_gate_up)
    x, w_gate_up, w_down = x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)
    if impl == "reference":
        return moe_experts_reference(x, expert_ids, weights, w_gate_up, w_down)
    return torch.ops.optimus.moe_experts(x, expert_ids, weights, w_gate_up, w_down, impl)[0]


# --- the routed experts as one torch.library op: FakeTensor, the dry run and torch.compile see a single op
# (routing, host group sizes and the per-expert loop stay inside). Its backward is a second op. The
# implementations are the autograd Functions above, driven through a stand-in for autograd's ctx.


class _Ctx:
    """What the Functions' forward/backward use of autograd's ctx: saved tensors and attributes."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _implementation(impl: str, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor):
    plan = _plan(impl, x, w_gate_up, w_down)
    return (CpuExpertMLP, ()) if plan is None else (_FusedExperts, plan)


# torch.library.define + impl rather than the custom_op decorator: that one imports torch._dynamo (and
# with it triton) at the first call, which CPU-only runs should not pay for.
torch.library.define("optimus::moe_experts", "(Tensor x, Tensor expert_ids, Tensor weights, Tensor w_gate_up, "
                     "Tensor w_down, str impl) -> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define("optimus::moe_experts_backward", "(Tensor grad_out, Tensor x, Tensor weights, Tensor w_gate_up, "
                     "Tensor w_down, Tensor(a!) gate_up, Tensor order, Tensor counts, str impl) "
                     "-> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.impl("optimus::moe_experts", "CompositeExplicitAutograd")
def _moe_experts_impl(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
    w_down: torch.Tensor, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, D], gate_up output [T*k, 2F] for backward, sort order [T*k], rows per expert [E])."""
    routing = Routing.from_expert_ids(expert_ids, w_gate_up.shape[0])
    function, plan = _implementation(impl, x, w_gate_up, w_down)
    ctx = _Ctx()
    if function is CpuExpertMLP:
        out = CpuExpertMLP.forward(ctx, x, w_gate_up, w_down, weights, routing)
    else:
        out = _FusedExperts.forward(ctx, x, w_gate_up, w_down, weights, routing, routing.groups, *plan)
    return out, ctx.saved_tensors[-1], routing.order, routing.groups.counts


@torch.library.register_fake("optimus::moe_experts")
def _(x, expert_ids, weights, w_gate_up, w_down, impl):
    rows = expert_ids.numel()
    return (x.new_empty(x.shape), x.new_empty(rows, w_gate_up.shape[2]),
            expert_ids.new_empty(rows, dtype=torch.int64), expert_ids.new_empty(w_gate_up.shape[0], dtype=torch.int64))


@torch.library.impl("optimus::moe_experts_backward", "CompositeExplicitAutograd")
def _moe_experts_backward_impl(
    grad_out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    gate_up: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad w_gate_up, grad w_down, grad weights); overwrites gate_up with its gradient."""
    routing = Routing(order, counts, weights.shape[1])
    function, plan = _implementation(impl, x, w_gate_up, w_down)
    ctx = _Ctx()
    if function is CpuExpertMLP:
        ctx.save_for_backward(x, w_gate_up, w_down, weights, gate_up)
        ctx.routing, ctx.step = routing, chunk_rows(gate_up.shape[1], x.dtype)
        grads = CpuExpertMLP.backward(ctx, grad_out)
    else:
        row_weights = weights.reshape(-1)[order]
        ctx.save_for_backward(x, w_gate_up, w_down, row_weights, gate_up)
        ctx.routing, ctx.groups, (ctx.gemm, ctx.row_backend) = routing, routing.groups, plan
        grads = _FusedExperts.backward(ctx, grad_out)
    grad_x, grad_w_gate_up, grad_w_down, grad_weights = grads[:4]
    return grad_x, grad_w_gate_up, grad_w_down, grad_weights


@torch.library.register_fake("optimus::moe_experts_backward")
def _(grad_out, x, weights, w_gate_up, w_down, gate_up, order, counts, impl):
    return x.new_empty(x.shape), w_gate_up.new_empty(w_gate_up.shape), w_down.new_empty(w_down.shape), \
        weights.new_empty(weights.shape)


def _save_for_experts_backward(ctx, inputs, output):
    x, _, weights, w_gate_up, w_down, impl = inputs
    _, gate_up, order, counts = output
    ctx.save_for_backward(x, weights, w_gate_up, w_down, gate_up, order, counts)
    ctx.impl = impl
    # gate_up is an output only so that backward can have it: left to its default, autograd would zero-fill a
    # [T k, 2F] "gradient" for it every layer and step
    ctx.set_materialize_grads(False)


def _experts_backward(ctx, grad_out, *unused_grads):
    if grad_out is None:  # the layer's output reached no backward (not materialized above)
        return None, None, None, None, None, None
    x, weights, w_gate_up, w_down, gate_up, order, counts = ctx.saved_tensors
    grad_x, grad_w_gate_up, grad_w_down, grad_weights = torch.ops.optimus.moe_experts_backward(
        grad_out.contiguous(), x, weights, w_gate_up, w_down, gate_up, order, counts, ctx.impl)
    return grad_x, None, grad_weights, grad_w_gate_up, grad_w_down, None


torch.library.register_autograd("optimus::moe_experts", _experts_backward, setup_context=_save_for_experts_backward)


# expert_mlp over already sorted rows (expert parallelism's local experts), the same way
torch.library.define("optimus::expert_mlp", "(Tensor rows, Tensor w_gate_up, Tensor w_down, Tensor counts, str impl) "
                     "-> (Tensor, Tensor)")
torch.library.define("optimus::expert_mlp_backward", "(Tensor grad_out, Tensor rows, Tensor w_gate_up, Tensor w_down, "
                     "Tensor(a!) gate_up, Tensor counts, str impl) -> (Tensor, Tensor, Tensor)")


def _identity_routing(rows: torch.Tensor, counts: torch.Tensor) -> Routing:
    # the CPU path in its general form: row j is "token" j with one slot and no weight
    return Routing(torch.arange(rows.shape[0], device=rows.device), counts, top_k=1)


@torch.library.impl("optimus::expert_mlp", "CompositeExplicitAutograd")
def _expert_mlp_impl(rows, w_gate_up, w_down, counts, impl):
    """(out [M, D], gate_up output [M, 2F] for backward)."""
    function, plan = _implementation(impl, rows, w_gate_up, w_down)
    ctx = _Ctx()
    if function is CpuExpertMLP:
        out = CpuExpertMLP.forward(ctx, rows, w_gate_up, w_down, None, _identity_routing(rows, counts))
    else:
        out = _FusedExperts.forward(ctx, rows, w_gate_up, w_down, None, None, Groups(counts), *plan)
    return out, ctx.saved_tensors[-1]


@torch.library.register_fake("optimus::expert_mlp")
def _(rows, w_gate_up, w_down, counts, impl):
    return rows.new_empty(rows.shape[0], w_down.shape[2]), rows.new_empty(rows.shape[0], w_gate_up.shape[2])


@torch.library.impl("optimus::expert_mlp_backward", "CompositeExplicitAutograd")
def _expert_mlp_backward_impl(grad_out, rows, w_gate_up, w_down, gate_up, counts, impl):
    """(grad rows, grad w_gate_up, grad w_down); overwrites gate_up with its gradient."""
    function, plan = _implementation(impl, rows, w_gate_up, w_down)
    ctx = _Ctx()
    ctx.save_for_backward(rows, w_gate_up, w_down, None, gate_up)
    if function is CpuExpertMLP:
        ctx.routing, ctx.step = _identity_routing(rows, counts), chunk_rows(gate_up.shape[1], rows.dtype)
        grads = CpuExpertMLP.backward(ctx, grad_out)
    else:
        ctx.routing, ctx.groups, (ctx.gemm, ctx.row_backend) = None, Groups(counts), plan
        grads = _FusedExperts.backward(ctx, grad_out)
    return grads[0], grads[1], grads[2]


@torch.library.register_fake("optimus::expert_mlp_backward")
def _(grad_out, rows, w_gate_up, w_down, gate_up, counts, impl):
    return rows.new_empty(rows.shape), w_gate_up.new_empty(w_gate_up.shape), w_down.new_empty(w_down.shape)


def _save_for_expert_mlp_backward(ctx, inputs, output):
    rows, w_gate_up, w_down, counts, impl = inputs
    ctx.save_for_backward(rows, w_gate_up, w_down, output[1], counts)
    ctx.impl = impl
    ctx.set_materialize_grads(False)  # as for moe_experts: no zero-filled gradient of gate_up


def _expert_mlp_backward(ctx, grad_out, *unused_grads):
    if grad_out is None:
        return None, None, None, None, None
    rows, w_gate_up, w_down, gate_up, counts = ctx.saved_tensors
    grad_rows, grad_w_gate_up, grad_w_down = torch.ops.optimus.expert_mlp_backward(
        grad_out.contiguous(), rows, w_gate_up, w_down, gate_up, counts, ctx.impl)
    return grad_rows, grad_w_gate_up, grad_w_down, None, None


torch.library.register_autograd("optimus::expert_mlp", _expert_mlp_backward, setup_context=_save_for_expert_mlp_backward)
