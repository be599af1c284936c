"""Fused LM head + cross-entropy that never holds the full [tokens, vocab] fp32 logits.

The loss head is the largest single cost of a small model's step on CPU (a 50k vocabulary): the
plain path writes fp32 logits, reads them for log-softmax, writes their gradient, and reads it
twice more. Here each chunk of rows computes its logits, loss and both gradients while the chunk
is hot in cache; the backward pass only scales the stored gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of softmax(h @ weight.T) against labels (ignore_index -100)."""
    return F.cross_entropy(F.linear(h, weight).float(), labels, ignore_index=IGNORE_INDEX)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, chunk by chunk, both gradients; backward only scales them.

    Matmuls follow the ambient autocast (bf16 under mixed precision); the log-softmax is fp32.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int):
        needs_grad = any(ctx.needs_input_grad[:2])
        valid = labels != IGNORE_INDEX
        n_valid = valid.sum().clamp(min=1)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if needs_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_grad else None
        for start in range(0, h.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h_chunk, ok = h[rows], valid[rows]
            safe_y = torch.where(ok, labels[rows], 0).unsqueeze(1)
            logits = F.linear(h_chunk, weight).float()
            log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
            target_logit = logits.gather(1, safe_y)
            total += ((log_z - target_logit).squeeze(1) * ok).sum()
            if not needs_grad:
                continue
            # d(mean CE)/d logits = (softmax - onehot) / n_valid, zero on ignored rows; built in place
            grad_logits = logits.sub_(log_z).exp_()
            grad_logits.scatter_add_(1, safe_y, torch.full_like(target_logit, -1.0))
            grad_logits.mul_((ok / n_valid).unsqueeze(1))
            grad_h[rows] = grad_logits @ weight
            grad_w += grad_logits.t() @ h_chunk
        if needs_grad:
            ctx.weight_dtype = weight.dtype
            ctx.save_for_backward(grad_h, grad_w)
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), (grad_w * grad_loss).to(ctx.weight_dtype), None, None


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 1024
) -> torch.Tensor:
    """Mean cross-entropy of softmax(h @ weight.T); h [N, D], weight [V, D], labels [N] (-100 ignored)."""
    if h.device.type != "cpu":
        # On accelerators the plain path is fast and torch.compile fuses it.
        return linear_cross_entropy_reference(h, weight, labels)
    return _ChunkedLinearCrossEntropy.apply(h, weight, labels, chunk_rows)
