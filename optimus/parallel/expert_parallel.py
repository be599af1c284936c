"""Expert parallelism: each EP rank holds n_experts / ep experts and computes them for every EP rank.

The seam is the MoE layer's experts module, `experts(tokens, expert_ids, weights) -> [T, D]`:
`apply_expert_parallel` swaps each MoE layer's `GroupedExperts` for an `ExpertParallelExperts`
whose weights are DTensors sharded Shard(0) over mesh["ep"] (same parameter names, so DCP
checkpoints and `get_model_state_dict` keep working and reshard), and whose forward

    sort token copies by global expert -> dispatch rows to the ranks owning their experts
    -> expert MLP on local experts -> return rows to their owners -> weighted combine

gives the same result as the single-device experts. Two dispatch styles, both dropless and differentiable:
  * "all_to_all": exchange per-expert counts, then one uneven all_to_all_single each way.
  * "allgather" (the Aurora team's): all-gather every rank's tokens, expert ids and router weights, compute
    the local experts on the copies routed to them and combine them per token, reduce-scatter the partial
    sums back to the tokens' owners (robust where all-to-all is not). It moves ep x the tokens each way, not
    ep x their top_k copies: the combine comes before the reduce-scatter.

Gradient convention: an expert's weight gradient receives the tokens of every EP rank through the
dispatch, i.e. the sum of ep ranks' local-batch gradients. We scale it by 1/ep inside the forward
(`_ScaleGrad`), so that afterwards *every* parameter's gradient is this rank's share, to be averaged
over the ranks that replicate it: non-expert weights over mesh["dp"], expert weights over
mesh["expert_dp"] -- plain FSDP/DDP averaging. (torchtitan instead leaves the sum and sets FSDP's
gradient divide factor to dp; that needs ReduceOp.PREMUL_SUM, which gloo lacks.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from optimus import ops
from optimus.models.moe import GroupedExperts, MoE
from optimus.ops.routing import inverse_permutation
from optimus.parallel.collective_ops import all_gather_rows, all_to_all_rows, reduce_scatter_rows

EP_DISPATCH_STYLES = ("all_to_all", "allgather")


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # a scale of 1 (one rank in the group) would still be a full pass over the experts' weight gradients
        return (grad if ctx.scale == 1.0 else grad * ctx.scale), None


def segment_starts(counts: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum: the first row of each segment, same shape as counts."""
    flat = counts.reshape(-1)
    return (torch.cumsum(flat, 0) - flat).view_as(counts)


def gather_index(counts: torch.Tensor, starts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Row indices that visit the segments in row-major order of `counts` (any shape), each segment
    `counts[i]` rows long starting at `starts[i]`. `total` (= counts.sum(), when the caller knows it
    on the host already) saves a device sync."""
    flat_counts, flat_starts = counts.reshape(-1), starts.reshape(-1)
    total = int(flat_counts.sum()) if total is None else total
    seg = torch.repeat_interleave(torch.arange(flat_counts.numel(), device=counts.device), flat_counts, output_size=total)
    offset_in_seg = torch.arange(total, device=counts.device) - (torch.cumsum(flat_counts, 0) - flat_counts)[seg]
    return flat_starts[seg] + offset_in_seg


def _row_sums(host_counts: list[int], width: int) -> list[int]:
    """Sums of consecutive runs of `width` counts: rows per rank from rows per (rank, expert)."""
    return [sum(host_counts[i : i + width]) for i in range(0, len(host_counts), width)]


class ExpertParallelExperts(nn.Module):
    """GroupedExperts with its experts split over mesh["ep"]; same parameter names and global shapes."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh, dispatch: str):
        super().__init__()
        if dispatch not in EP_DISPATCH_STYLES:
            raise ValueError(f"parallel.ep_dispatch must be one of {EP_DISPATCH_STYLES}, got '{dispatch}'")
        self.impl, self.dispatch, self.ep_mesh = experts.impl, dispatch, ep_mesh
        self.ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        self.n_experts = experts.w_gate_up.shape[0]
        if self.n_experts % self.ep:
            raise ValueError(f"parallel.ep ({self.ep}) must divide n_experts ({self.n_experts})")
        self.n_local = self.n_experts // self.ep
        for name in ("w_gate_up", "w_down"):
            # Every rank built the same full weights (one seed), so each keeps its own slice: no communication.
            local = getattr(experts, name).detach()[rank * self.n_local : (rank + 1) * self.n_local]
            shard = DTensor.from_local(local.clone(), ep_mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(shard, requires_grad=getattr(experts, name).requires_grad))

    def _local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        # DTensor Shard(0) over ep -> this rank's experts (plain already when FSDP has unsharded them)
        local = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w_gate_up, self.w_down)]
        return _ScaleGrad.apply(local[0], 1.0 / self.ep), _ScaleGrad.apply(local[1], 1.0 / self.ep)

    def _compute(self, rows: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        w_gate_up, w_down = self._local_weights()
        impl = "reference" if self.impl == "reference" else "auto"
        return ops.expert_mlp(rows, w_gate_up, w_down, local_counts, impl=impl)

    def forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """As GroupedExperts.forward, with each token copy computed on the EP rank owning its expert."""
        if self.dispatch == "allgather":
            return self._forward_allgather(tokens, expert_ids, weights, self.n_experts)
        impl = "reference" if self.impl == "reference" else "auto"
        rows, order, counts = ops.permute_tokens(tokens, expert_ids, self.n_experts, impl=impl)
        rows = self._forward_all_to_all(rows, counts)
        return ops.unpermute_tokens(rows, order, weights, impl=impl)

    def _forward_all_to_all(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group, P, El = self.ep_mesh.get_group(), self.ep, self.n_local
        # recv_counts[q, e]: rows rank q sends to my local expert e
        recv_counts = all_to_all_rows(counts, [El] * P, [El] * P, group)
        # the one host read of this dispatch (a device sync on GPUs): the splits size the exchange
        host = torch.cat([counts, recv_counts]).tolist()
        in_splits, out_splits = _row_sums(host[: P * El], El), _row_sums(host[P * El :], El)
        recv_counts = recv_counts.view(P, El)
        received = all_to_all_rows(rows, out_splits, in_splits, group)  # (source rank, expert) order
        # reorder to (expert, source rank) for the grouped GEMM, and back afterwards
        order = gather_index(recv_counts.t(), segment_starts(recv_counts).t(), total=sum(out_splits))
        computed = self._compute(received.index_select(0, order), recv_counts.sum(0))
        # back by a gather through the inverse order: autograd keeps only the index (index_copy's backward would
        # keep `computed` itself, [rows, D] per layer, to the end of the backward)
        restored = computed.index_select(0, inverse_permutation(order))
        return all_to_all_rows(restored, in_splits, out_splits, group)

    def _forward_allgather(self, tokens: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           n_ids: int) -> torch.Tensor:
        """Every ep rank's tokens [T, D], expert ids and router weights [T, k] gathered; this rank's experts
        computed on the copies routed to them and combined per token; each token's partial sum reduce-scattered
        back to its owner. `ids` number the experts split over ep (ep x n_local of them, rank r's from r x
        n_local); an id of n_ids or more is a copy no rank of this group computes (tensor parallelism's other
        columns)."""
        group, El = self.ep_mesh.get_group(), self.n_local
        rank, impl = self.ep_mesh.get_local_rank(), "reference" if self.impl == "reference" else "auto"
        # every rank's token count (equal in training; a rank's last evaluation batch may be short), read on the
        # host: the gathered buffers are padded to the longest, the padding's copies routed nowhere. Exchanged as a
        # CPU tensor where the group also runs gloo (the launcher's "cpu:gloo,<accelerator>" groups): no device
        # sync before the one permute_tokens makes
        n_tokens = tokens.shape[0]
        sizes = torch.tensor([n_tokens])
        if tokens.device.type != "cpu" and "gloo" not in str(dist.get_backend(group)):
            sizes = sizes.to(tokens.device)
        width = max(max(all_gather_rows(sizes, group).tolist()), 1)
        if n_tokens < width:
            pad = width - n_tokens
            tokens = torch.cat([tokens, tokens.new_zeros(pad, tokens.shape[1])])
            ids = torch.cat([ids, ids.new_full((pad, ids.shape[1]), n_ids)])
            weights = torch.cat([weights, weights.new_zeros(pad, weights.shape[1])])
        gathered = all_gather_rows(tokens, group)  # [P * width, D]; the gradient is reduce-scattered (summed)
        gathered_ids, gathered_weights = all_gather_rows(ids, group), all_gather_rows(weights, group)
        # my experts first (0 .. El - 1), every other copy in one trailing group whose rows are never built
        local = gathered_ids - rank * El
        local = torch.where((local >= 0) & (local < El), local, torch.full_like(local, El))
        rows, order, counts = ops.permute_tokens(gathered, local, El + 1, impl=impl, groups_kept=El)
        computed = self._compute(rows, counts[:El])
        combined = ops.unpermute_tokens(computed, order, gathered_weights, impl=impl)  # [P * width, D], partial
        mine = reduce_scatter_rows(combined, group)
        # the padding's rows dropped in a copy: a module returning a view would lose FSDP's pre-backward hook
        return mine if n_tokens == width else mine[:n_tokens].clone()


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, dispatch: str = "all_to_all") -> nn.Module:
    """Split every MoE layer's experts over `ep_mesh` (1-D, e.g. mesh["ep"]) in place; returns model.

    Call after the pipeline split and tensor parallelism, before activation checkpointing, compile and
    FSDP (see parallelize.py); experts already split over tp are then split over (ep, tp). Works on
    materialised weights (each rank keeps its slice of the identically seeded full weights) and on the
    meta device.
    """
    if ep_mesh.size() == 1:
        return model
    from optimus.parallel.expert_tensor_parallel import TensorParallelExperts

    for module in list(model.modules()):
        if isinstance(module, MoE) and isinstance(module.experts, TensorParallelExperts):
            # tensor parallelism split the experts over tp already: split them over (ep, tp)
            module.experts = module.experts.split_over_ep(ep_mesh, dispatch)
        elif isinstance(module, MoE) and isinstance(module.experts, GroupedExperts):
            module.experts = ExpertParallelExperts(module.experts, ep_mesh, dispatch)
    return model
