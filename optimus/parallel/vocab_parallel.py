"""Vocabulary-parallel LM head and fused cross-entropy: no tp rank holds full-vocabulary logits.

`apply_tensor_parallel` replaces the model's LMHead with a `VocabParallelLMHead`: its weight is
one DTensor Shard(0) over tp (the checkpoint key `lm_head.weight` and its full shape are those of
the single-device head, so DCP reshards it to and from any other tp), and each rank computes the
logits of its own rows of the vocabulary only.

The loss (Megatron-Core's vocab-parallel cross-entropy, chunked over tokens as
ops.cross_entropy is): for each chunk of at most `chunk_rows` tokens a rank computes its local
logits [chunk, V/tp], their log-sum-exp and, where it owns the target, the target logit; one
all-gather of those two numbers per token gives every rank the global log-sum-exp (a logsumexp
over the ranks' ones; Megatron's all-reduce MAX then SUM of exponentials computes the same in two
collectives) and the target logit. The loss is global lse - target logit, averaged over the
non-ignored tokens exactly as the single-process loss. Gradients are formed in the same pass, in
fp32: softmax over the whole vocabulary restricted to this rank's columns, minus the one-hot where
this rank owns the target. The weight gradient is local (this rank's rows); the gradient reaching
the hidden states is this rank's share and is summed over tp on the way back (a reduce-scatter
under sequence parallelism, where the hidden states entered the head as an all-gather; else an
all-reduce).

Logits are gathered along the vocabulary only when asked for (generation, evaluation, HF parity:
`model(ids).logits`); training and the loss path never gather them.

Vocabulary sizes that tp does not divide are fine: the rows are split as DTensor splits them
(ceil-sized blocks, the last ones shorter or empty), the loss needs no padding token and every
size agrees with the embedding's split, FSDP and DCP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from optimus.ops.cross_entropy import DEFAULT_CHUNK_ROWS, IGNORE_INDEX, _compute_dtype
from optimus.parallel.collectives import all_gather_single, reduce_scatter_single
from optimus.parallel.group_autograd import sum_grad_over_group, sum_over_group


def vocab_split(vocab_size: int, tp: int) -> list[int]:
    """Rows of the vocabulary each tp rank holds, as DTensor's Shard(0) splits them (torch.chunk)."""
    block = -(-vocab_size // tp)
    return [max(0, min(block, vocab_size - rank * block)) for rank in range(tp)]


def _all_gather_stacked(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """[size, *x.shape]: every rank's x, in rank order."""
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x.contiguous(), group=group)  # gloo wants the dim-0 concatenation
    return out.view(size, *x.shape)


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/tp, D] sequence shards -> [B, S, D], every rank's in rank order."""
    out = _all_gather_stacked(x.contiguous(), dist.get_world_size(group), group)
    return out.movedim(0, 1).flatten(1, 2)  # [B, tp, S/tp, D] -> [B, S, D]


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's [B, S, D] -> their sum's [B, S/tp, D] shard of this rank's tokens."""
    tp = dist.get_world_size(group)
    batch, seq = x.shape[0], x.shape[1]
    parts = x.reshape(batch, tp, seq // tp, *x.shape[2:]).movedim(1, 0).contiguous()
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, parts.flatten(0, 1), group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """[B, S/tp, D] sequence shards -> [B, S, D] on every rank; backward reduce-scatters (sums the
    ranks' gradient shares and hands each rank its own tokens')."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Every rank's partial [B, S, D] -> the sum's sequence shard [B, S/tp, D]; backward all-gathers (each
    rank's partial got the whole output's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_sequence(grad, ctx.group), None


class _GatherVocab(torch.autograd.Function):
    """This rank's logits [..., V_r] -> the full logits [..., V] on every rank; backward takes this
    rank's columns (the gradient of the full logits is the same on every rank)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, sizes: tuple[int, ...], start: int) -> torch.Tensor:
        ctx.columns = (start, local.shape[-1])
        block = max(sizes)
        padded = F.pad(local, (0, block - local.shape[-1])).contiguous()
        out = _all_gather_stacked(padded, len(sizes), group)
        return torch.cat([out[rank][..., :size] for rank, size in enumerate(sizes)], dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, width = ctx.columns
        return grad[..., start:start + width].contiguous(), None, None, None


@torch.no_grad()
def _loss_and_gradients(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_start: int, group,
                        chunk_rows: int, needs_grad: bool):
    """(mean loss, grad_h share, grad_w, n_valid) of the vocab-parallel cross-entropy; the gradients are
    those of the *sum* of the per-token losses (backward scales them), empty when not needs_grad."""
    dtype = _compute_dtype(h)
    tp = dist.get_world_size(group)
    n, d_model, local_vocab = h.shape[0], h.shape[1], weight.shape[0]
    new = dict(device=h.device)
    valid = labels != IGNORE_INDEX
    n_valid = valid.sum().clamp(min=1)
    local_target = labels - vocab_start
    owned = valid & (local_target >= 0) & (local_target < local_vocab)
    local_target = torch.where(owned, local_target, 0)
    rows = max(1, min(chunk_rows, n))
    losses = torch.empty(n, dtype=torch.float32, **new)
    grad_h = torch.empty(0, dtype=dtype, **new)
    grad_w = torch.empty(0, dtype=torch.float32, **new)
    with torch.autocast(h.device.type, enabled=False):
        h_c, w_c = h.to(dtype), weight.to(dtype)  # cast once for all chunks
        probs_buf = torch.empty(rows, local_vocab, dtype=torch.float32, **new)  # fp32 softmax and gradient
        # fp32 logits are computed straight into the softmax's buffer; bf16 ones get their own and a cast
        logits_buf = probs_buf if dtype == torch.float32 else torch.empty(rows, local_vocab, dtype=dtype, **new)
        if needs_grad:
            grad_h = torch.zeros(n, d_model, dtype=dtype, **new)
            # the first chunk writes it (no zero fill of a [V/tp, D] buffer per micro-batch), as the fused loss does
            grad_w = (torch.empty if n else torch.zeros)(local_vocab, d_model, dtype=torch.float32, **new)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            h_chunk, targets, mine = h_c[start:stop], local_target[start:stop], owned[start:stop]
            index = torch.arange(stop - start, **new)
            if local_vocab:
                logits = torch.mm(h_chunk, w_c.t(), out=logits_buf[: stop - start])
                probs = probs_buf[: stop - start]
                if logits_buf is not probs_buf:  # bf16 logits: the fp32 softmax starts from their copy
                    probs.copy_(logits)
                target_logit = torch.where(mine, probs[index, targets], 0.0)
                local_max = probs.amax(dim=1)
                probs.sub_(local_max[:, None]).exp_()  # exp(logit - local max)
                local_lse = local_max + probs.sum(dim=1).log()
            else:  # a rank with no rows of a small vocabulary: contributes exp(-inf) = 0
                local_lse = torch.full((stop - start,), float("-inf"), **new)
                target_logit = torch.zeros(stop - start, **new)
            everyone = _all_gather_stacked(torch.stack([local_lse, target_logit]), tp, group)
            lse = torch.logsumexp(everyone[:, 0], dim=0)
            losses[start:stop] = lse - everyone[:, 1].sum(dim=0)
            if not needs_grad or not local_vocab:
                continue
            # softmax over the whole vocabulary, this rank's columns: exp(logit - lse), zero on ignored tokens
            # (they give no gradient) in the same pass
            probs.mul_((torch.exp(local_max - lse) * valid[start:stop])[:, None])
            probs.index_put_((index, targets), -mine.float(), accumulate=True)  # minus the one-hot it owns
            grad_logits = probs.to(dtype)
            torch.mm(grad_logits, w_c, out=grad_h[start:stop])
            if dtype == torch.float32:
                if start == 0:
                    torch.mm(grad_logits.t(), h_chunk, out=grad_w)
                else:
                    grad_w.addmm_(grad_logits.t(), h_chunk)
            elif start == 0:
                grad_w.copy_(torch.mm(grad_logits.t(), h_chunk))
            else:
                grad_w.add_(torch.mm(grad_logits.t(), h_chunk))
    return (losses * valid).sum() / n_valid, grad_h, grad_w, n_valid


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of h @ weight.T over the vocabulary split across tp; the gradient it gives h
    is this rank's share (the caller sums it over tp)."""

    @staticmethod
    def forward(ctx, h, weight, labels, vocab_start: int, group, chunk_rows: int, needs_grad: bool):
        loss, grad_h, grad_w, n_valid = _loss_and_gradients(h, weight, labels, vocab_start, group, chunk_rows,
                                                             needs_grad)
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.save_for_backward(grad_h, grad_w, n_valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w, n_valid = ctx.saved_tensors
        scale = grad_loss / n_valid
        h_dtype, w_dtype = ctx.dtypes
        # in place: our own buffers, and the [V/tp, D] one is large
        return grad_h.mul_(scale).to(h_dtype), grad_w.mul_(scale).to(w_dtype), None, None, None, None, None


def _needs_grad(h: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)


def vocab_parallel_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                                 group, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """Mean cross-entropy of softmax(h @ W.T) where this tp rank holds rows [vocab_start, vocab_start + V_r)
    of W as `weight` [V_r, D]; h [N, D] and labels [N] (-100 ignored) the same on every rank of `group`.

    Every rank returns the same loss; h's gradient is the full single-process one (summed over the
    group in backward), weight's gradient is that of this rank's rows.
    """
    h = sum_grad_over_group(h, group)
    return _VocabParallelCrossEntropy.apply(h, weight, labels, vocab_start, group, chunk_rows,
                                            _needs_grad(h, weight))


class VocabParallelEmbedding(nn.Module):
    """The token embedding split over the vocabulary across tp (Megatron's VocabParallelEmbedding).

    Each rank looks up the tokens of its own rows (the others read zeros) and the ranks' partial outputs are
    summed: reduce-scattered to sequence shards [B, S/tp, D] under sequence parallelism, else all-reduced.
    The weight is one DTensor Shard(0) over tp (the checkpoint key `embed.weight` and its full shape are the
    single-device embedding's). Not torch's RowwiseParallel: its backward (torch 2.13) builds a dense gradient
    of the whole vocabulary on every rank before keeping its rows ([V, D] fp32, 412 MB at V = 50k, D = 2,048);
    here the backward scatters into this rank's [V/tp, D] only.
    """

    def __init__(self, embed: nn.Embedding, tp_mesh: DeviceMesh, sequence_parallel: bool):
        super().__init__()
        self.group = tp_mesh.get_group()
        self.sequence_parallel = sequence_parallel
        sizes = vocab_split(embed.weight.shape[0], tp_mesh.size())
        rank = tp_mesh.get_local_rank()
        self.vocab_start, self.vocab_rows = sum(sizes[:rank]), sizes[rank]
        self.weight = nn.Parameter(distribute_tensor(embed.weight.detach(), tp_mesh, [Shard(0)]))
        if self.weight.to_local().shape[0] != self.vocab_rows:  # guards vocab_split against DTensor's rule
            raise RuntimeError(f"vocab rows on tp rank {rank}: DTensor holds {self.weight.to_local().shape[0]}, "
                               f"vocab_split says {self.vocab_rows}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # under FSDP the unsharded parameter is a DTensor over tp too; zero1/zero2 keep it as it is
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        partial = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return _ReduceScatterSequence.apply(partial, self.group)
        return sum_over_group(partial, self.group)


class VocabParallelLMHead(nn.Module):
    """The LM head split over the vocabulary across tp, with the vocab-parallel loss (see the module doc).

    Input: the final hidden states, sequence shards [B, S/tp, D] under sequence parallelism, else
    all tokens [B, S, D] (the same on every rank). The weight is one DTensor Shard(0) over tp.
    """

    def __init__(self, head: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS):
        super().__init__()
        self.vocab_size = head.weight.shape[0]
        self.group = tp_mesh.get_group()
        self.sequence_parallel = sequence_parallel
        self.chunk_rows = chunk_rows
        self.sizes = tuple(vocab_split(self.vocab_size, tp_mesh.size()))
        rank = tp_mesh.get_local_rank()
        self.vocab_start = sum(self.sizes[:rank])
        self.weight = nn.Parameter(distribute_tensor(head.weight.detach(), tp_mesh, [Shard(0)]))
        if self.weight.to_local().shape[0] != self.sizes[rank]:  # guards vocab_split against DTensor's rule
            raise RuntimeError(f"vocab rows on tp rank {rank}: DTensor holds {self.weight.to_local().shape[0]}, "
                               f"vocab_split says {self.sizes[rank]}")

    def _local_weight(self) -> torch.Tensor:
        # under FSDP the unsharded parameter is a DTensor over tp too; zero1/zero2 keep it as it is
        return self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight

    def _all_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """Every token's hidden state on every rank; its gradient is summed over tp in backward."""
        if self.sequence_parallel:
            return _GatherSequence.apply(h, self.group)
        return sum_grad_over_group(h, self.group)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The full logits [B, S, V] (gathered along the vocabulary: for generation and evaluation only)."""
        local = F.linear(self._all_tokens(h), self._local_weight())
        return _GatherVocab.apply(local, self.group, self.sizes, self.vocab_start)

    def cross_entropy(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy against labels [B, S] (-100 ignored), the same on every tp rank; no rank
        holds more than [chunk_rows, V/tp] logits."""
        h = self._all_tokens(h).flatten(0, -2)
        weight = self._local_weight()
        return _VocabParallelCrossEntropy.apply(h, weight, labels.flatten(), self.vocab_start, self.group,
                                                self.chunk_rows, _needs_grad(h, weight))
