"""Tensor + sequence parallelism for the decoder, as DTensor plans (parallelize_module).

What is split over the tp mesh, and why:
- attention: q/k/v column-parallel (each rank owns n_heads/tp query heads and n_kv_heads/tp KV
  heads), o_proj row-parallel. The model's attention reshapes with -1 heads, so it runs
  unchanged on its local heads.
- QK-norm is full-width (one RMS over all heads, as OLMoE/OLMo-2 compute it). Under TP a rank
  holds only its heads' slice, so `ShardedRMSNorm` replaces q_norm/k_norm: it all-reduces the
  sum of squares over tp (autograd-aware) and scales its own slice of the weight. That is the
  exact full-width RMS, and the weight stays one full-width DTensor (checkpoints unchanged).
- dense MLP: gate/up column-parallel, down row-parallel.
- MoE blocks: the tp ranks split the experts (expert_tensor_parallel.py): the input is gathered,
  every tp rank routes the same tokens but computes only its own experts' token copies, and the
  partial outputs are reduce-scattered back to sequence shards.
- sequence parallel: between blocks the residual stream is split along the sequence; norms run
  on the local tokens (SequenceParallel), attention/MLP inputs are all-gathered and their
  outputs reduce-scattered.
- embedding: vocab-parallel (`vocab_parallel.VocabParallelEmbedding`: each rank looks up its own rows), the
  partial outputs reduce-scattered to sequence shards.
- final norm: on the local tokens under sequence parallelism (SequenceParallel), like the
  blocks' norms.
- LM head and loss: vocab-parallel (`vocab_parallel.VocabParallelLMHead` replaces the model's
  LMHead, as ShardedRMSNorm replaces QK-norm): the weight is one DTensor Shard(0) over tp, each
  rank computes the logits and the softmax statistics of its own vocabulary rows, chunk by chunk,
  and the fused vocab-parallel cross-entropy combines them with one small collective per chunk.
  No rank holds full-vocabulary logits in training; `model(ids).logits` gathers them.
  The final hidden states enter the head all-gathered along the sequence (their gradient
  reduce-scattered back). A vocabulary that tp does not divide is split unevenly, as DTensor splits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from optimus.models.layers import RMSNorm
from optimus.models.moe import MoE
from optimus.ops.cross_entropy import IGNORE_INDEX
from optimus.parallel.collective_ops import all_reduce_sum
from optimus.parallel.expert_tensor_parallel import apply_expert_tensor_parallel
from optimus.parallel.vocab_parallel import VocabParallelEmbedding, VocabParallelLMHead


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a feature dimension that is split across the tp ranks (full-width QK-norm).

    Input: this rank's contiguous slice [..., width/tp]. The mean square is taken over the whole
    width (local sums of squares all-reduced), so the output slice equals the slice of the
    single-device RMSNorm output. The weight is a DTensor Shard(0) over tp: its full shape and
    checkpoint key are those of the single-device norm.
    """

    def __init__(self, norm: RMSNorm, tp_mesh: DeviceMesh):
        super().__init__()
        self.eps = norm.eps
        self.full_width = norm.weight.shape[0]
        self.group = tp_mesh.get_group()
        self.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), tp_mesh, [Shard(0)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        square_sum = all_reduce_sum(x32.pow(2).sum(-1, keepdim=True), self.group, sum_grad=True)
        normed = x32 * torch.rsqrt(square_sum / self.full_width + self.eps)
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        return weight * normed.to(x.dtype)


# The gathered input of attention and of the dense MLP stays a DTensor (use_local_output=False, as torchtitan
# plans it): q, k and v (gate and up) then share it, autograd sums their partial input gradients on each rank,
# and one reduce-scatter (one all-reduce without sequence parallelism) brings the sum back. Handed over as a
# plain tensor, each projection wrapped it again and all-reduced its own gradient: 5 full-activation all-reduces
# a dense block's backward where 2 reduce-scatters do (20 of 1 MiB a step of the tiny dense model at tp 2).
def _attention_plan(sequence_parallel: bool) -> dict:
    gathered = Shard(1) if sequence_parallel else Replicate()
    return {
        "attn": PrepareModuleInput(
            input_layouts=(gathered, None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=False
        ),
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=gathered),
    }


def _dense_mlp_plan(sequence_parallel: bool) -> dict:
    residual = Shard(1) if sequence_parallel else Replicate()
    return {
        "mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_output=False),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=residual),
    }


def _pad_sequence_to_tp_multiple(forward, tp: int):
    """Wrap Transformer.forward so any sequence length works under sequence parallelism.

    Sequence shards must be equal (gloo has no uneven reduce-scatter). Training lengths divide tp;
    a prompt in generation may not. Right-padding is exact for a causal model: no position
    attends to a later one; padded labels are ignored by the loss (MoE router statistics would
    count the padded tokens, which only matters for losses of uneven lengths).
    """

    @functools.wraps(forward)
    def padded_forward(input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        seq = input_ids.shape[1]
        pad = -seq % tp
        if pad == 0:
            return forward(input_ids, labels)
        input_ids = F.pad(input_ids, (0, pad))
        if labels is not None:
            labels = F.pad(labels, (0, pad), value=IGNORE_INDEX)
        out = forward(input_ids, labels)
        if out.logits is not None:
            out.logits = out.logits[:, :seq]
        return out

    return padded_forward


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> nn.Module:
    """Split `model` (a Transformer, or a pipeline stage of one) over `tp_mesh` in place.

    Works on the meta device (the usual path: weights are loaded into the shards afterwards, see
    parallelize.build_parallel_model) and on materialised weights (DTensor then keeps each rank's
    slice of the full tensor, so every rank must hold the same full weights beforehand).
    """
    root_plan: dict = {}
    if getattr(model, "norm", None) is not None and sequence_parallel:
        # on the local tokens: the vocab-parallel head gathers them itself (after the norm, not before)
        root_plan["norm"] = SequenceParallel(use_local_output=True)
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    if getattr(model, "embed", None) is not None:
        model.embed = VocabParallelEmbedding(model.embed, tp_mesh, sequence_parallel)
    if getattr(model, "lm_head", None) is not None:
        model.lm_head = VocabParallelLMHead(model.lm_head, tp_mesh, sequence_parallel)
    if sequence_parallel and getattr(model, "embed", None) is not None:
        model.forward = _pad_sequence_to_tp_multiple(model.forward, tp_mesh.size())
    for block in model.layers.values():
        plan = _attention_plan(sequence_parallel)
        if sequence_parallel:  # local outputs: the residual stream between blocks stays plain tensors
            plan.update({"attn_norm": SequenceParallel(use_local_output=True),
                         "mlp_norm": SequenceParallel(use_local_output=True)})
        if isinstance(block.mlp, MoE):
            apply_expert_tensor_parallel(block.mlp, tp_mesh, sequence_parallel)
        else:
            plan.update(_dense_mlp_plan(sequence_parallel))
        parallelize_module(block, tp_mesh, plan)
        attn = block.attn
        if attn.q_norm is not None:
            attn.q_norm = ShardedRMSNorm(attn.q_norm, tp_mesh)
            attn.k_norm = ShardedRMSNorm(attn.k_norm, tp_mesh)
    return model
