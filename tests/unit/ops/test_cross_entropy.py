"""The chunked CPU loss head equals the plain F.linear + F.cross_entropy path."""

import pytest
import torch

from optimus.ops.cross_entropy import IGNORE_INDEX, linear_cross_entropy, linear_cross_entropy_reference
from tests.helpers.dispatch import OpCounter


def _case(seed: int = 0, n: int = 97, d: int = 16, vocab: int = 300):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(vocab, d, generator=g) * 0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[:5] = IGNORE_INDEX
    return h, w, labels


def _loss_and_grads(fn, h, w, labels, autocast: bool = False):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, labels)
    (3.0 * loss).backward()  # a non-unit upstream gradient
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_rows", [1, 7, 32, 1000])
def test_fp32_matches_reference(chunk_rows):
    h, w, labels = _case()
    ref = _loss_and_grads(linear_cross_entropy_reference, h, w, labels)
    got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_rows=chunk_rows), h, w, labels)
    for r, g in zip(ref, got):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_underflowing_target_probability_is_exact():
    h, w, labels = _case()
    h[10] *= 50.0  # huge logits: the target's softmax probability underflows to 0
    w[labels[10]] = 0.0
    ref = _loss_and_grads(linear_cross_entropy_reference, h, w, labels)
    got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_rows=16), h, w, labels)
    assert torch.isfinite(got[0])
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_close_to_reference():
    h, w, labels = _case()
    ref = _loss_and_grads(linear_cross_entropy_reference, h, w, labels, autocast=True)
    got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_rows=32), h, w, labels, autocast=True)
    torch.testing.assert_close(got[0], ref[0], rtol=2e-3, atol=2e-3)
    for r, g in zip(ref[1:], got[1:]):
        assert g.dtype == torch.float32  # gradients come back in the parameters' dtype
        assert (g - r).abs().max() <= 2e-2 * r.abs().max()


def test_no_grad_and_all_ignored():
    h, w, labels = _case()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, labels), linear_cross_entropy_reference(h, w, labels))
    ignored = torch.full_like(labels, IGNORE_INDEX)
    assert linear_cross_entropy(h, w, ignored).item() == 0.0


def test_no_rows_gives_zero_loss_and_zero_gradients():
    h = torch.randn(0, 4, requires_grad=True)
    w = torch.randn(7, 4, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.empty(0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and w.grad.abs().sum().item() == 0.0 and h.grad.shape == (0, 4)


def test_bf16_weight_gradient_in_vocabulary_slices_equals_one_slice(monkeypatch):
    """Under bf16 the weight gradient is summed slice by slice of the vocabulary (GRAD_W_SLICE_ROWS), over
    several chunks of rows: 300 = 4 x 64 + 44 rows give what one slice gives."""
    from optimus.ops import cross_entropy

    h, w, labels = _case()
    whole = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_rows=32), h, w, labels, autocast=True)
    monkeypatch.setattr(cross_entropy, "GRAD_W_SLICE_ROWS", 64)
    sliced = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_rows=32), h, w, labels, autocast=True)
    for a, b in zip(whole, sliced):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_backward_builds_no_zero_gradients_for_its_buffers():
    """The op hands its gradient buffers to backward as outputs; autograd must not zero-fill a [V, D] (and an
    [N, D]) "gradient" for them each step: backward only scales the buffers."""
    h, w, labels = _case()
    loss = linear_cross_entropy(h.requires_grad_(), w.requires_grad_(), labels)
    with OpCounter() as counted:
        loss.backward()
    assert counted.calls["aten.zeros.default"] == 0 and counted.calls["aten.fill_.Scalar"] == 0, counted.calls
