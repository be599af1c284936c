"""permute_tokens / unpermute_tokens against the references, gradients for x, rows and weights."""

import pytest
import torch

from optimus.ops import permute_tokens, permute_tokens_reference, unpermute_tokens, unpermute_tokens_reference
from optimus.ops.permute import ROW_DOT_CHUNK, row_dots
from tests.helpers.ops import ROUTINGS, assert_close, check_against_reference, moe_inputs

SHAPES = {"top1": (19, 1, 6), "top2": (13, 2, 5), "top8": (11, 8, 16)}


def _routing_inputs(shape, routing, dtype):
    n_tokens, top_k, n_experts = shape
    return moe_inputs(n_tokens, 12, 4, n_experts, top_k, routing, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_permute_matches_reference(shape, routing, dtype):
    inputs = _routing_inputs(SHAPES[shape], routing, dtype)
    n_experts = SHAPES[shape][2]
    rows, order, counts = permute_tokens(inputs["x"], inputs["expert_ids"], n_experts)
    ref_rows, ref_order, ref_counts = permute_tokens_reference(inputs["x"], inputs["expert_ids"], n_experts)
    assert torch.equal(order, ref_order) and torch.equal(counts, ref_counts)
    assert torch.equal(rows, ref_rows)  # a pure copy: exact in any dtype
    grad = torch.randn(rows.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (grad_x,) = torch.autograd.grad(rows, inputs["x"], grad)
    (ref_grad_x,) = torch.autograd.grad(ref_rows, inputs["x"], grad)
    assert_close(grad_x, ref_grad_x, dtype, "dx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["uniform", "one_expert"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_unpermute_matches_reference(shape, routing, dtype):
    base = _routing_inputs(SHAPES[shape], routing, dtype)
    n_experts = SHAPES[shape][2]
    rows, order, _ = permute_tokens_reference(base["x"].detach(), base["expert_ids"], n_experts)
    inputs = {"rows": (rows * 1.5).requires_grad_(), "order": order, "weights": base["weights"]}
    check_against_reference(unpermute_tokens, unpermute_tokens_reference, inputs, ("rows", "weights"), dtype, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups_kept", [0, 1, 3, 5])
def test_first_groups_only_match_zero_padded_reference(groups_kept, dtype):
    """The tensor-parallel experts' path: gather and combine only the first experts' rows, the rest as zeros."""
    inputs = _routing_inputs(SHAPES["top2"], "skewed", dtype)
    n_experts = SHAPES["top2"][2]
    rows, order, counts = permute_tokens(inputs["x"], inputs["expert_ids"], n_experts, groups_kept=groups_kept)
    ref_rows, ref_order, ref_counts = permute_tokens_reference(inputs["x"], inputs["expert_ids"], n_experts)
    n_kept = sum(counts.tolist()[:groups_kept])
    assert torch.equal(order, ref_order) and torch.equal(counts, ref_counts)
    assert rows.shape[0] == n_kept <= ref_rows.shape[0] and torch.equal(rows, ref_rows[:n_kept])
    scaled = (rows * 1.5).detach().requires_grad_()
    weights = inputs["weights"]
    out = unpermute_tokens(scaled, order, weights)
    padded = torch.cat([scaled, scaled.new_zeros(order.numel() - n_kept, scaled.shape[1])])
    ref_out = unpermute_tokens_reference(padded, order, weights)
    assert_close(out, ref_out, dtype, "combine")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = torch.autograd.grad(out, (scaled, weights), grad)
    want = torch.autograd.grad(ref_out, (scaled, weights), grad)
    assert_close(got[0], want[0], dtype, "d rows")
    assert_close(got[1], want[1], dtype, "d weights")
    dropped = ~torch.isin(torch.arange(order.numel()), order[:n_kept]).view_as(weights)
    assert torch.all(got[1][dropped] == 0)  # slots of rows another rank computes take no gradient here
    grad_rows = torch.randn(rows.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    (grad_x,) = torch.autograd.grad(rows, inputs["x"], grad_rows)
    (ref_grad_x,) = torch.autograd.grad(ref_rows[:n_kept], inputs["x"], grad_rows)
    assert_close(grad_x, ref_grad_x, dtype, "dx")


def test_round_trip_is_identity_with_unit_weights():
    inputs = moe_inputs(9, 8, 4, 4, 2, "skewed")
    rows, order, _ = permute_tokens(inputs["x"], inputs["expert_ids"], 4)
    out = unpermute_tokens(rows, order, torch.full((9, 2), 0.5))
    torch.testing.assert_close(out, inputs["x"])


def test_no_tokens():
    x = torch.zeros(0, 8, requires_grad=True)
    rows, order, counts = permute_tokens(x, torch.zeros(0, 2, dtype=torch.int64), 4)
    assert rows.shape == (0, 8) and counts.tolist() == [0, 0, 0, 0]
    out = unpermute_tokens(rows, order, torch.zeros(0, 2))
    assert out.shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 5, ROW_DOT_CHUNK, 2 * ROW_DOT_CHUNK + 3])
def test_row_dots_are_vecdot_chunk_by_chunk(rows, dtype):
    a, b = torch.randn(rows, 24, dtype=dtype), torch.randn(rows, 24, dtype=dtype)
    assert torch.equal(row_dots(a, b), torch.linalg.vecdot(a, b))
