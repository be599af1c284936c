"""Our fused ops are torch.library ops: FakeTensor runs their fake implementations, and torch.compile
traces a whole MoE block and the loss head without a graph break at them (host syncs stay inside)."""

from __future__ import annotations

import pytest
import torch

from optimus.models.layers import rotary_cos_sin
from optimus.models.transformer import build_model
from optimus.ops.cross_entropy import linear_cross_entropy
from tests.helpers.ops import moe_inputs
from tests.helpers.parity import tiny_config


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _moe_block():
    config = tiny_config(moe=True).model
    block = build_model(config, seed=0).layers["0"]
    x = torch.randn(2, 32, config.d_model, requires_grad=True)
    cos, sin = rotary_cos_sin(32, config.head_dim, config.rope_theta, x.device, x.dtype)
    return block, (x, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_fused_experts_and_loss_head(dtype):
    """Schema, fake implementation and autograd registration agree with the real kernels."""
    inputs = moe_inputs(16, 8, 6, 4, 2, dtype=dtype)
    args = (inputs["x"], inputs["expert_ids"], inputs["weights"], inputs["w_gate_up"], inputs["w_down"], "auto")
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.optimus.moe_experts, args, test_utils=checks)
    rows = inputs["x"].detach().repeat(2, 1).requires_grad_()  # 32 sorted rows, 4 experts
    counts = torch.tensor([10, 0, 15, 7])
    torch.library.opcheck(torch.ops.optimus.expert_mlp, (rows, inputs["w_gate_up"], inputs["w_down"], counts, "auto"),
                          test_utils=checks)
    h = torch.randn(12, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 8, dtype=dtype, requires_grad=True)
    labels = torch.tensor([1, 2, -100, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    torch.library.opcheck(torch.ops.optimus.chunked_linear_cross_entropy, (h, weight, labels, 5, True),
                          test_utils=checks)


def test_moe_block_and_loss_head_trace_without_graph_breaks():
    block, args = _moe_block()
    explained = torch._dynamo.explain(block)(*args)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    weight = torch.randn(100, 64, requires_grad=True)
    h, labels = torch.randn(64, 64, requires_grad=True), torch.randint(0, 100, (64,))
    explained = torch._dynamo.explain(linear_cross_entropy)(h, weight, labels)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]


def test_compiled_moe_block_matches_eager():
    """fullgraph through AOTAutograd (the fake implementations and the registered backward)."""
    block, (x, cos, sin) = _moe_block()
    out, stats = block(x, cos, sin)
    (out.square().sum() + stats.aux_loss).backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out_c, stats_c = compiled(x, cos, sin)
    (out_c.square().sum() + stats_c.aux_loss).backward()
    torch.testing.assert_close(out_c, out)
    got = [x.grad] + [p.grad for p in block.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
