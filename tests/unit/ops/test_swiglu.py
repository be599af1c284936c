"""SwiGLU (and its row-scaled primitive form) against plain autograd."""

import pytest
import torch

from optimus.ops import swiglu, swiglu_reference
from optimus.ops.swiglu import swiglu_backward, swiglu_forward
from tests.helpers.ops import assert_close, check_against_reference

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 10), (2, 3, 34), (1, 2)])
def test_swiglu_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    inputs = {"gate_up": (torch.randn(*shape, generator=gen) * 3).to(dtype).requires_grad_()}
    check_against_reference(lambda gate_up: swiglu(gate_up, impl="torch"), swiglu_reference, inputs, ("gate_up",), dtype)


def test_swiglu_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.zeros(2, 5))


@pytest.mark.parametrize("in_place", [False, True])
def test_row_scaled_primitives(in_place):
    gen = torch.Generator().manual_seed(1)
    h = (torch.randn(9, 16, generator=gen) * 2).requires_grad_()
    scale = torch.rand(9, generator=gen).requires_grad_()
    grad = torch.randn(9, 8, generator=gen)
    expected = swiglu_reference(h) * scale[:, None]
    expected_dh, expected_dscale = torch.autograd.grad(expected, (h, scale), grad)

    h_work = h.detach().clone()
    out = swiglu_forward(h_work, scale.detach())
    dh, dscale = swiglu_backward(h_work, grad, scale.detach(), in_place=in_place)
    assert_close(out, expected, torch.float32, "forward")
    assert_close(dh, expected_dh, torch.float32, "dh")
    assert_close(dscale, expected_dscale, torch.float32, "dscale")
    assert (dh.data_ptr() == h_work.data_ptr()) == in_place


def test_saves_only_the_input():
    gate_up = torch.randn(4, 6, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gate_up, impl="torch")
    assert len(saved) == 1 and saved[0] is gate_up
