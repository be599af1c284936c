"""grouped_mm against the per-group reference: forward, dgrad, wgrad, empty groups, fp32/bf16."""

import pytest
import torch

from optimus.ops import grouped_mm, grouped_mm_reference

from tests.helpers.ops import check_against_reference

COUNTS = {
    "uneven": [5, 0, 17, 1, 0, 9],
    "one_group": [0, 0, 32, 0],
    "all_empty_but_last": [0, 0, 0, 3],
    "single_rows": [1, 1, 1, 1, 1],
}


def _inputs(counts, k, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), k, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(len(counts), k, n, generator=gen) * k**-0.5).to(dtype).requires_grad_()
    return {"x": x, "w": w, "counts": counts}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["auto", "loop", "torch"])
@pytest.mark.parametrize("case", list(COUNTS))
def test_matches_reference(case, impl, dtype):
    # torch._grouped_mm wants 16-byte aligned rows: 24 and 40 columns are, in both dtypes
    inputs = _inputs(COUNTS[case], 24, 40, dtype)
    fast = lambda x, w, counts: grouped_mm(x, w, counts, impl=impl)
    check_against_reference(fast, grouped_mm_reference, inputs, ("x", "w"), dtype, f"{case}/{impl}")


@pytest.mark.parametrize("impl", ["auto", "loop"])
def test_odd_sizes(impl):
    inputs = _inputs([3, 0, 7, 2], 5, 11, torch.float32, seed=3)
    fast = lambda x, w, counts: grouped_mm(x, w, counts, impl=impl)
    check_against_reference(fast, grouped_mm_reference, inputs, ("x", "w"), torch.float32, impl)


@pytest.mark.parametrize("impl", ["loop", "torch"])
def test_expanded_gradient(impl):
    # y.sum().backward() hands backward a stride-0 gradient; torch._grouped_mm alone rejects it
    inputs = _inputs([4, 0, 4], 8, 8, torch.float32)
    grouped_mm(inputs["x"], inputs["w"], inputs["counts"], impl=impl).sum().backward()
    expected_w = torch.stack([inputs["x"][:4].sum(0), torch.zeros(8), inputs["x"][4:].sum(0)])
    torch.testing.assert_close(inputs["w"].grad, expected_w.detach().unsqueeze(-1).expand(3, 8, 8))


def test_no_rows():
    x = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    y = grouped_mm(x, w, torch.zeros(3, dtype=torch.int64))
    assert y.shape == (0, 4)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown impl"):
        grouped_mm(torch.zeros(2, 4), torch.zeros(1, 4, 4), torch.tensor([2]), impl="magic")
    with pytest.raises(ValueError, match="shapes disagree"):
        grouped_mm(torch.zeros(2, 4), torch.zeros(1, 5, 4), torch.tensor([2]))
    with pytest.raises(ValueError, match="16 bytes"):
        grouped_mm(torch.zeros(2, 3), torch.zeros(1, 3, 3), torch.tensor([2]), impl="torch")


def test_torch_grouped_mm_needs_16_byte_row_strides():
    """torch._grouped_mm's rule: every stride but the unit one a multiple of 16 bytes. A bf16 row of 4 columns is 8
    bytes (refused, as in fp32 a row of 3); 8 bf16 or 4 fp32 columns are 16 bytes (accepted)."""
    from optimus.ops._device import torch_grouped_mm_accepts

    bf16 = torch.bfloat16
    assert torch_grouped_mm_accepts(torch.zeros(2, 8, dtype=bf16), torch.zeros(1, 8, 8, dtype=bf16))
    assert torch_grouped_mm_accepts(torch.zeros(2, 4), torch.zeros(1, 4, 4))
    assert torch_grouped_mm_accepts(torch.zeros(1, 4, dtype=bf16))  # one row: its stride never steps
    for columns in (4, 12):  # 8 and 24 bytes
        assert not torch_grouped_mm_accepts(torch.zeros(2, columns, dtype=bf16))
    with pytest.raises(ValueError, match="16 bytes"):
        grouped_mm(torch.zeros(2, 4, dtype=bf16), torch.zeros(1, 4, 4, dtype=bf16), torch.tensor([2]), impl="torch")
