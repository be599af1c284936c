"""Tensor parallelism for MoE blocks: the tp ranks split the experts between them.

Under TP the tokens of an MoE block are already on every tp rank (sequence parallelism gathers them
for the block, as for attention and the dense MLP). So each tp rank keeps n_experts / tp experts and
computes only the token copies routed to them; the partial outputs (each token's sum over this
rank's experts) are then reduce-scattered back to sequence shards (or all-reduced without sequence
parallelism). No tp rank runs every expert on every token, and each holds 1/tp of the expert weights.

Why experts split over tp, and not Megatron-Core's expert-TP (each expert's FFN split column/row-wise):
- Our expert weights are `w_gate_up [E, D, 2F]` with the gate and up columns merged. An F-split
  gives each rank two separate column ranges (its gate columns and the matching up columns), but
  DCP records one contiguous box per shard: checkpoints would lose their single-device form and
  tp=1 resharding (keeping Shard(2) instead would put all gate columns on one rank and all up
  columns on another, and SwiGLU would need an all-to-all of [T k, F] activations per layer).
  Splitting along the expert dim is Shard(0): the same placement expert parallelism uses.
- Its GEMMs stay whole-width (F/tp-wide expert GEMMs run far below peak for fine-grained experts,
  whose F is already small: 1024 for OLMoE), and its communication is Megatron's SP MLP pattern
  (all-gather in, reduce-scatter out): expert-TP moves the same bytes.
- Its cost: the tp ranks share the routing's imbalance (a rank's load is its experts' tokens).
So there is no `expert_tp` knob: splitting the experts is the one scheme (docs/scaling.md).

What runs where, and why the gradients come out exact:
- The router runs on every tp rank on the same tokens, so router statistics (aux loss, z-loss,
  expert counts) are the single-process ones, computed identically on every tp rank as before.
- Gradients of the block input: the expert part is partial per tp rank and is summed by the
  backward of the input gather (a reduce-scatter). The router part is the same on every tp rank,
  so the router's input gradient is scaled by 1/tp (a hook on the router) before that sum.
- The router weights handed to the experts get an all-reduce in backward: each rank's experts give
  part of their gradient, and the router (replicated, its weight not a DTensor over tp) needs all.
- With ep > 1 the experts are split over (ep, tp): rank (i, t) owns expert block i * tp + t
  (placements Shard(0), Shard(0) on mesh ("ep", "tp")). tp rank t handles its tp column (blocks
  t, tp + t, ...) and exchanges over its ep group exactly as expert parallelism does
  (ExpertParallelExperts), including its 1/ep gradient scaling: all_to_all dispatches the column's
  copies; allgather gathers the tokens with their column ids (the other columns' copies routed
  nowhere) and combines before its reduce-scatter.

Costs besides the experts' own: each tp rank sorts all T k token copies' expert ids (the other
ranks' copies into one trailing group), reads its row count on the host (a device sync, as expert
parallelism's dispatch does), and gathers and combines its own rows only: the other ranks' copies
are zero rows that are never built (their slots' router weights take no gradient on this rank).

Weights stay DTensors of the single-device shapes and names (`experts.w_gate_up`, `experts.w_down`),
so DCP checkpoints reshard to and from any layout, tp=1 included.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from optimus import ops
from optimus.models.moe import GroupedExperts, MoE
from optimus.parallel.collective_ops import all_gather_rows, reduce_scatter_rows
from optimus.parallel.expert_parallel import EP_DISPATCH_STYLES, ExpertParallelExperts, _ScaleGrad
from optimus.parallel.group_autograd import sum_grad_over_group, sum_over_group


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/tp, ...] sequence shard -> [B, S, ...]; backward reduce-scatters (sums) the gradient."""
    gathered = all_gather_rows(x.movedim(1, 0), group)
    return gathered.movedim(0, 1)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, ...] partial sums -> this rank's [B, S/tp, ...] shard of their sum; backward all-gathers."""
    return reduce_scatter_rows(x.movedim(1, 0), group).movedim(0, 1)


def _is_meta(tensor: torch.Tensor) -> bool:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).is_meta


def _full(weight: torch.Tensor) -> torch.Tensor:
    """The whole weight (collective over its mesh when sharded; meta stays meta)."""
    if not isinstance(weight, DTensor):
        return weight.detach()
    if _is_meta(weight):
        return torch.empty(weight.shape, dtype=weight.dtype, device="meta")
    return weight.detach().full_tensor()


class TensorParallelExperts(ExpertParallelExperts):
    """The experts of an MoE block split over tp (and over ep first when ep > 1): same names, global shapes.

    forward(tokens, expert_ids, weights) -> this tp rank's part of the experts' output: the weighted
    sum over this rank's experts only (summed over tp by the MoE block's output hook).
    """

    def __init__(self, experts: GroupedExperts | "TensorParallelExperts", tp_mesh: DeviceMesh,
                 ep_mesh: DeviceMesh | None = None, dispatch: str = "all_to_all"):
        # ExpertParallelExperts' dispatch and compute are reused; its __init__ (ep-only slicing) is not
        nn.Module.__init__(self)
        if dispatch not in EP_DISPATCH_STYLES:
            raise ValueError(f"parallel.ep_dispatch must be one of {EP_DISPATCH_STYLES}, got '{dispatch}'")
        self.impl, self.dispatch, self.tp_mesh, self.ep_mesh = experts.impl, dispatch, tp_mesh, ep_mesh
        self.tp, self.tp_rank = tp_mesh.size(), tp_mesh.get_local_rank()
        self.ep = ep_mesh.size() if ep_mesh is not None else 1
        ep_rank = ep_mesh.get_local_rank() if ep_mesh is not None else 0
        self.n_experts = experts.w_gate_up.shape[0]
        if self.n_experts % (self.ep * self.tp):
            raise ValueError(f"parallel.ep x tp ({self.ep} x {self.tp}) must divide n_experts ({self.n_experts})")
        self.n_local = self.n_experts // (self.ep * self.tp)
        block = ep_rank * self.tp + self.tp_rank  # the expert block this rank owns
        mesh = tp_mesh if ep_mesh is None else DeviceMesh._concatenate([ep_mesh, tp_mesh])
        placements = [Shard(0)] * mesh.ndim
        for name in ("w_gate_up", "w_down"):
            weight = getattr(experts, name)
            # every rank holds the same full weights (one seed) or meta ones: each keeps its block, no communication
            # except when re-splitting an already tp-split layer over ep (materialised weights only)
            local = _full(weight)[block * self.n_local : (block + 1) * self.n_local].clone()
            shard = DTensor.from_local(local, mesh, placements, run_check=False)
            setattr(self, name, nn.Parameter(shard, requires_grad=weight.requires_grad))

    def forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """As GroupedExperts.forward restricted to this rank's experts (the others' copies contribute 0)."""
        impl = "reference" if self.impl == "reference" else "auto"
        weights = sum_grad_over_group(weights, self.tp_mesh.get_group())
        n_column = self.ep * self.n_local  # experts of this tp column: n_local on each ep rank
        block = torch.div(expert_ids, self.n_local, rounding_mode="floor")
        mine = torch.remainder(block, self.tp) == self.tp_rank
        # my column's experts in (ep rank, local expert) order; other ranks' copies go to one last group
        column_id = torch.div(block, self.tp, rounding_mode="floor") * self.n_local + torch.remainder(
            expert_ids, self.n_local)
        ids = torch.where(mine, column_id, torch.full_like(expert_ids, n_column))
        if self.ep > 1 and self.dispatch == "allgather":  # the ep group gathers the tokens and combines first
            return self._forward_allgather(tokens, ids, weights, n_column)
        # only this column's rows are gathered (the one host read here, a device sync on GPUs: how many they are),
        # and combined: the other ranks' copies count as zero rows, never built
        rows, order, counts = ops.permute_tokens(tokens, ids, n_column + 1, impl=impl, groups_kept=n_column)
        column_counts = counts[:n_column]
        if self.ep == 1:
            computed = self._compute(rows, column_counts)
        else:
            computed = self._forward_all_to_all(rows, column_counts)
        return ops.unpermute_tokens(computed, order, weights, impl=impl)

    def split_over_ep(self, ep_mesh: DeviceMesh, dispatch: str) -> "TensorParallelExperts":
        """These experts split over (ep, tp): expert parallelism applied after tensor parallelism."""
        return TensorParallelExperts(self, self.tp_mesh, ep_mesh, dispatch)


def apply_expert_tensor_parallel(moe: MoE, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split `moe`'s experts over `tp_mesh` in place and wire its input/output over tp (see module docstring).

    Input: the residual stream, sequence-sharded (sequence_parallel) or replicated over tp. Output:
    the same layout. Works on the meta device and on materialised (identically seeded) weights.
    """
    tp, group = tp_mesh.size(), tp_mesh.get_group()
    if not isinstance(moe.experts, GroupedExperts):
        raise ValueError(f"expected an MoE block with GroupedExperts, got {type(moe.experts).__name__}: "
                         f"apply tensor parallelism before expert parallelism")
    moe.experts = TensorParallelExperts(moe.experts, tp_mesh)

    def gather_input(module, args):
        x = args[0]
        x = gather_sequence(x, group) if sequence_parallel else sum_grad_over_group(x, group)
        return (x, *args[1:])

    def reduce_output(module, args, output):
        out, stats = output
        out = reduce_scatter_sequence(out, group) if sequence_parallel else sum_over_group(out, group)
        return out, stats

    def router_input(module, args):
        # every tp rank backpropagates the same router gradient into the block input; the input
        # gather's backward sums over tp, so each contributes 1/tp of it
        return (_ScaleGrad.apply(args[0], 1.0 / tp), *args[1:])

    moe.register_forward_pre_hook(gather_input)
    moe.register_forward_hook(reduce_output)
    moe.router.register_forward_pre_hook(router_input)
