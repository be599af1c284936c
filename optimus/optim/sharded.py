"""The distributed optimizer: parallel.shard_mode zero1 / zero2 (fsdp is FSDP2's own sharding).

Parameters stay whole on every data-parallel rank (in the compute dtype; TP and EP placements
unchanged: we work on their local tensors). They are laid end to end in flat buckets, each padded only
to a multiple of its sharding group's size, and each rank owns one contiguous segment of every bucket
(optim/flat.py), as Megatron-Core's distributed optimizer shards them: of a parameter a rank owns
nothing, all of it or a flat range, and keeps fp32 master weights and AdamW moments for what it owns
only. Cutting each parameter into per-rank row blocks instead (as FSDP2's Shard(0)) pads a parameter
with fewer rows than the group has ranks to one row per rank: 64-expert tensors over 3,072 ranks, 48x.
A step:

    zero1: gradients accumulate whole over the micro-batches, then are reduce-scattered in flat
           buckets at the step (one reduce-scatter per bucket and step; whole gradients held until then)
    zero2: in every micro-batch's backward, each bucket is reduce-scattered as soon as backward has
           produced all its gradients (post-accumulate-grad hooks), the result summed into a fp32
           shard accumulator and the whole gradients freed: between backwards a rank holds only its
           gradient shards (1/group of zero1's whole gradients), during one the buckets in flight;
           the price is a reduce-scatter per micro-batch instead of per step
    -> global gradient norm from the shards (one all-reduce), clipping
    -> torch AdamW on the owned ranges (AdamW is elementwise: the same math as one process)
    -> all-gather of the updated segments back into the whole parameters.

Sharding groups (EP-aware, the default): non-expert parameters are replicated over every
data-parallel rank, expert parallel ones included, so their state is sharded over mesh["dp"]
(DP x EP); expert weights are already split by EP, so theirs is sharded over the ranks holding the
same experts, mesh["expert_dp"]. ep_aware=False is the ablation baseline: non-expert state sharded
over expert_dp only and replicated across EP (each EP rank repeats the same update); their
gradients are reduce-scattered over expert_dp and then all-reduced over ep.
Averaging is FSDP mode's: non-expert gradients averaged over dp, expert gradients over expert_dp
(expert_parallel already scaled them by 1/ep in the forward).

The parameters are not views into the bucket buffers (they stay ordinary whole tensors, as every other
mode has them): one copy each way, through two persistent buffers that the buckets take turns over
(optim/buffers.py): gradients packed straight into one, cast to the reduce dtype in the copy (fp32; bf16 under
parallel.grad_reduce_dtype=bf16: half the bytes, summed in bf16, the shard fp32 again); gathered segments
copied straight from it into the parameters.

Checkpoints stay per parameter, whatever the buckets: state_dict() is the flattened form
get_optimizer_state_dict gives for FSDP ("state.<name>.exp_avg", "param_groups.<name>.lr"), each moment
of the parameter's global shape, this rank holding its flat range of the parameter's local (EP/TP)
tensor as a few rectangular boxes placed at that tensor's global offset (checkpoint/flat_range.py), so
DCP reshards between layouts, group sizes and shard modes. Under bf16 the fp32 master ranges are saved
too ("state.<name>.master"). A checkpoint without them (fsdp, whose sharded fp32 parameters are its
masters, or an fp32 zero run) fills them from the saved parameters at full precision:
OptimizerState.stand_ins names "model.<name>" for CheckpointManager.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from optimus.checkpoint.flat_range import FlatRangeTensor
from optimus.optim.flat import Slot, checkpoint_view, cut_buckets, local_tensor
from optimus.optim.buffers import BucketBuffers, bucket_order, buffer_nbytes
from optimus.optim.build import fused_adamw_runs_on
from optimus.optim.config import OptimConfig
from optimus.parallel.collectives import all_gather_single, reduce_scatter_single
from optimus.parallel.partial_grads import reduce_partial_gradients

# Megatron-Core's default bucket: big enough that per-collective latency does not dominate.
DEFAULT_BUCKET_NUMEL = 40_000_000
SHARD_MODES = ("fsdp", "zero1", "zero2", "ddp")


@dataclass(frozen=True)
class ZeroPlan:
    """What parallelize_model decided for zero1/zero2; build_optimizer reads it off the model."""

    mode: str  # "zero1" or "zero2"
    ep_aware: bool
    mesh: object  # optimus.parallel.mesh.ParallelMesh
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype = torch.float32  # what gradients travel and are summed in (parallel.grad_reduce_dtype)


@dataclass
class _ShardGroup:
    """Who shards a set of parameters' state and over whom their gradients are summed."""

    kind: str  # "expert" or "non_expert"
    mesh: DeviceMesh  # 1-D: the ranks that split the state
    extra_sum: DeviceMesh | None  # ep when non-expert state is replicated across ep (EP-unaware)
    average_over: int  # gradients are averaged over this many ranks (FSDP semantics)
    replicated_dims: tuple[str, ...]  # mesh dims holding copies of the same shard (counted once in the norm)


@dataclass(repr=False, eq=False)
class _Bucket:
    group: _ShardGroup
    slots: list[Slot]
    segment: int  # elements per rank
    total: int  # elements of the bucket's parameters (ranks x segment, less the padding tail)
    held: int  # of this rank's segment, those that are parameters' (then the padding tail)
    buffer: int = 0  # which of the persistent communication buffers (optim/buffers.py) it packs into
    shard: torch.Tensor | None = None  # persistent fp32 [segment], allocated on the first reduction
    grad_shard: torch.Tensor | None = None  # `shard` once this step reduced into it: this rank's segment summed
    # over ranks (and micro-batches)
    # its reduce-scatter in flight (at most one: its buffer is claimed before the next packing): (work, the
    # buffer's output to put into grad_shard when it lands, or None: it writes grad_shard itself, whether it is the
    # step's first reduction: copied, else added)
    pending: tuple | None = None
    finished: bool = False  # grad_shard averaged and handed to the masters as .grad
    arrived: set = None  # zero2: parameters whose gradient this backward has produced

    def __post_init__(self) -> None:
        self.arrived = set()


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The routed experts' weights (MoE layers' `experts` modules): split by EP, sharded over expert_dp."""
    from optimus.models.moe import MoE

    return {p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()}


class ShardedOptimizer:
    """AdamW with ZeRO-1/2 sharded state over EP-aware groups; the interface train_step uses.

    zero_grad, clip_grad_norm_(max_norm) -> global norm, step(), param_groups (for the learning
    rate), state_dict()/load_state_dict() (DCP), full_gradients() (tests), state_numel() (per-rank
    optimizer-state elements by kind), gradient_bytes() (gradient memory held now) and buffer_bytes()
    (its persistent communication buffers).
    """

    def __init__(self, model: nn.Module, config: OptimConfig, plan: ZeroPlan,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL):
        from optimus.optim.build import param_groups

        if plan.mode not in ("zero1", "zero2"):
            raise ValueError(f"ShardedOptimizer needs shard_mode zero1 or zero2, got {plan.mode!r}")
        self.plan, self.mode = plan, plan.mode
        mesh = plan.mesh
        ep = mesh.size("ep")
        dp = mesh.size("dp")
        experts = expert_parameters(model)
        expert_group = _ShardGroup("expert", mesh["expert_dp"], None, mesh.size("expert_dp"), ())
        if plan.ep_aware or ep == 1:
            dense_group = _ShardGroup("non_expert", mesh["dp"], None, dp, ())
        else:
            dense_group = _ShardGroup("non_expert", mesh["expert_dp"], mesh["ep"], dp, ("ep",))
        self._mesh = mesh
        decay_of = {p: g["weight_decay"] for g in param_groups(model, config.weight_decay) for p in g["params"]}
        by_group = bucket_order(model, experts)
        self.buckets: list[_Bucket] = []
        for kind, group in (("non_expert", dense_group), ("expert", expert_group)):
            self.buckets += self._make_buckets(by_group[kind], group, bucket_numel)
        self._slots = {slot.param: (slot, bucket) for bucket in self.buckets for slot in bucket.slots}
        self._init_masters(plan.compute_dtype)
        layout = [(bucket.group.mesh.size(), bucket.segment) for bucket in self.buckets]
        self.buffers = BucketBuffers(buffer_nbytes(layout, plan.compute_dtype.itemsize, self.mode == "zero2",
                                                   plan.reduce_dtype.itemsize), self._device)
        self._buffer_user: dict[int, _Bucket] = {}  # buffer -> the bucket whose reduce-scatter is using it
        for index, bucket in enumerate(self.buckets):
            bucket.buffer = self.buffers.index(index)
        groups = [{"params": [], "weight_decay": config.weight_decay}, {"params": [], "weight_decay": 0.0}]
        for slot, _ in self._slots.values():
            groups[0 if decay_of[slot.param] > 0 else 1]["params"].append(slot.master)
        groups = [g for g in groups if g["params"]]
        # masters are plain tensors: the fused kernel (one pass over param, grad and moments) applies
        fused = all(fused_adamw_runs_on(g["params"][0].device.type) for g in groups)
        self.inner = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                                       **({"fused": True} if fused else {"foreach": True}))
        # state exists from the start so a checkpoint can be loaded into it before the first step
        self._group_of: dict[int, dict] = {}  # id(master) -> its inner param group (per-name hyperparameters)
        for group in self.inner.param_groups:
            for master in group["params"]:
                self._group_of[id(master)] = group
                self.inner.state[master] = {
                    "step": torch.zeros((), dtype=torch.float32, device=master.device),
                    "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
        self._in_flight: list[_Bucket] = []  # buckets with a reduce-scatter in flight, oldest first
        self._flush_queued = False  # zero2: the end-of-backward callback is queued for the running backward
        if self.mode == "zero2":
            for param in self._slots:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)

    # --- construction -------------------------------------------------------------------------
    @staticmethod
    def _make_buckets(named: list, group: _ShardGroup, bucket_numel: int) -> list[_Bucket]:
        cut = cut_buckets(named, group.mesh.size(), group.mesh.get_local_rank(), bucket_numel)
        return [_Bucket(group, layout.slots, layout.segment, layout.total, layout.held) for layout in cut]

    @torch.no_grad()
    def _init_masters(self, compute_dtype: torch.dtype) -> None:
        for slot, _ in self._slots.values():
            local = local_tensor(slot.param).detach()
            if not local.is_contiguous():  # (the buckets are the local tensors' memory order)
                raise ValueError(f"zero1/zero2 need contiguous parameters; {slot.name} is not")
            owned = slot.owned(local)
            if local.dtype == torch.float32 and compute_dtype == torch.float32:
                slot.master, slot.aliased = owned, True  # fp32 parameters: the owned elements are the masters
            else:
                slot.master = owned.float().clone()
            if local.dtype != compute_dtype:  # whole parameters are kept in the compute dtype
                slot.param.data = slot.param.data.to(compute_dtype)

    # --- the interface train_step uses --------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """The inner AdamW's groups (set_lr writes the learning rate here)."""
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop whole gradients and reduced shards (the next step starts from nothing)."""
        self._land_all()  # a collective in flight must still complete on every rank
        self._flush_queued = False  # (a backward that raised never ran its end-of-backward callback)
        for param in self._slots:
            param.grad = None
        for bucket in self.buckets:
            bucket.grad_shard, bucket.finished = None, False
            bucket.arrived.clear()
        for slot, _ in self._slots.values():
            slot.master.grad = None

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Reduce what is not reduced yet, then the global L2 norm from the shards (returned), clipped
        to max_norm when max_norm > 0 with torch's formula (coef = max_norm / (norm + 1e-6), at most 1)."""
        self._reduce_all()
        squares = [torch.zeros((), dtype=torch.float32, device=self._device)]
        for bucket in self.buckets:
            counted = all(self._mesh.local_rank(d) == 0 for d in bucket.group.replicated_dims)
            for slot in bucket.slots:
                # a shard replicated over tp or ep is counted on one replica only
                if counted and self._counted_over_tp(slot.param):
                    squares.append(slot.master.grad.float().pow(2).sum())
        total_sq = torch.stack(squares).sum()
        if dist.is_initialized():
            dist.all_reduce(total_sq)  # every rank of the job: dp, ep, tp and pp shards summed once
        total = total_sq.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for bucket in self.buckets:
                bucket.grad_shard.mul_(coef)
        return total.item()

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the owned ranges, then all-gather the segments into the whole parameters."""
        self._reduce_all()
        self.inner.step()
        # two buckets' all-gathers in flight (in their two buffers): the next one travels while this one is
        # copied out
        in_flight: list = []
        for bucket in self.buckets:
            in_flight.append((bucket, self._start_gather(bucket)))
            if len(in_flight) > 1:
                self._finish_gather(*in_flight.pop(0))
        while in_flight:
            self._finish_gather(*in_flight.pop(0))

    # --- gradient reduction -------------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return next(iter(self._slots)).device

    def _counted_over_tp(self, param: nn.Parameter) -> bool:
        """False on tp ranks > 0 for a parameter whose local tensor is the same on every tp rank."""
        if "tp" not in self._mesh.world.mesh_dim_names or self._mesh.size("tp") == 1:
            return True
        if isinstance(param, DTensor) and "tp" in (param.device_mesh.mesh_dim_names or ()):
            index = param.device_mesh.mesh_dim_names.index("tp")
            if param.placements[index].is_shard():
                return True
        return self._mesh.local_rank("tp") == 0

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        # zero2: `param`'s gradient of this backward is complete; reduce its bucket once all of them are
        if not self._flush_queued:  # the first gradient of a backward: settle everything when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._flush_queued = True
        _, bucket = self._slots[param]
        bucket.arrived.add(param)
        if len(bucket.arrived) == len(bucket.slots):
            self._reduce_bucket(bucket)

    def _end_of_backward(self) -> None:
        # a bucket some of whose parameters got no gradient in this backward: reduce what it got (the
        # others add zeros, as one process would see); then wait, so only the shards outlive the backward
        self._flush_queued = False
        for bucket in self.buckets:
            if bucket.arrived:
                self._reduce_bucket(bucket)
        self._land_all()

    def _reduce_all(self) -> None:
        """At the step: reduce-scatter what is not reduced yet (zero1: everything), then finish every bucket."""
        for bucket in self.buckets:
            if bucket.grad_shard is None:
                self._reduce_bucket(bucket)
        for bucket in self.buckets:
            self._finish(bucket)

    @torch.no_grad()
    def _reduce_bucket(self, bucket: _Bucket) -> None:
        """Pack the bucket's whole gradients (end to end, in the reduce dtype) into its persistent buffer,
        free them, and start their reduce-scatter: in fp32 the step's first straight into the bucket's shard,
        otherwise into the buffer, copied (first) or summed (zero2's later micro-batches) into the fp32 shard when
        it lands (_land). With one rank nothing travels: the gradients are packed in fp32, unrounded."""
        size = bucket.group.mesh.size()
        self._claim(bucket.buffer)  # the buffer's previous reduce-scatter (this bucket's own too) has landed
        first = bucket.grad_shard is None
        if bucket.shard is None:
            bucket.shard = torch.empty(bucket.segment, dtype=torch.float32, device=self._device)
        if first:
            bucket.grad_shard = bucket.shard
        if size == 1 and first:  # nothing to reduce: the packed gradients are the shard
            self._pack(bucket, bucket.shard)
            return
        dtype = self.plan.reduce_dtype if size > 1 else torch.float32
        packed, out = self.buffers.views(bucket.buffer, size, bucket.segment, dtype)
        self._pack(bucket, packed.view(-1))
        if size == 1:
            bucket.grad_shard.add_(packed.view(-1))
            return
        straight = first and dtype == torch.float32
        target = bucket.grad_shard if straight else out
        work = reduce_scatter_single(target, packed.view(-1), group=bucket.group.mesh.get_group(), async_op=True)
        bucket.pending = (work, None if straight else out, first)
        self._buffer_user[bucket.buffer] = bucket
        self._in_flight.append(bucket)

    def _pack(self, bucket: _Bucket, packed: torch.Tensor) -> None:
        """Every slot's whole gradient into its place in `packed` ([ranks * segment]: every element written, the
        padding tail zeroed, as the buffer is reused), then drop the whole gradients (zero2 frees them in every
        backward: its memory saving)."""
        packed[bucket.total:].zero_()
        # the sequence-parallel norms' Partial gradients in this bucket: summed over tp together, not one by one
        reduce_partial_gradients([slot.param for slot in bucket.slots if slot.param.grad is not None])
        for slot in bucket.slots:
            region = packed[slot.offset:slot.offset + slot.numel]
            grad = slot.param.grad
            if grad is None:  # no gradient this step: it contributes zeros, as one process would see
                region.zero_()
                continue
            if isinstance(grad, DTensor):
                if grad.placements != slot.param.placements:
                    grad = grad.redistribute(slot.param.device_mesh, slot.param.placements)
                grad = grad._local_tensor
            region.copy_(grad.reshape(-1))  # (the cast to the reduce dtype fused into the copy)
            slot.param.grad = None
        bucket.arrived.clear()

    def _claim(self, buffer: int) -> None:
        """Land the reduce-scatter using `buffer`, if one is, before the buffer is packed again: this also bounds
        what is in flight to BUFFERS buckets (the next one travels while this one is packed)."""
        user = self._buffer_user.get(buffer)
        if user is not None:
            self._in_flight.remove(user)
            self._land(user)

    def _land(self, bucket: _Bucket) -> None:
        """Wait for the bucket's reduce-scatter and put its output into grad_shard: copied (the step's first
        reduction, cast to fp32) or added (later ones), unless the collective wrote grad_shard itself."""
        work, out, first = bucket.pending
        bucket.pending = None
        del self._buffer_user[bucket.buffer]
        work.wait()
        if out is not None:
            if first:
                bucket.grad_shard.copy_(out)
            else:
                bucket.grad_shard.add_(out)

    def _land_all(self) -> None:
        while self._in_flight:
            self._land(self._in_flight.pop(0))

    def _finish(self, bucket: _Bucket) -> None:
        """Once per step: the EP-unaware all-reduce over ep, averaging, and the shards as the masters' grads."""
        if bucket.finished:
            return
        if bucket.pending is not None:
            self._in_flight.remove(bucket)
            self._land(bucket)
        group, shard = bucket.group, bucket.grad_shard
        if group.extra_sum is not None and group.extra_sum.size() > 1:
            dist.all_reduce(shard, group=group.extra_sum.get_group())
        shard.div_(group.average_over)
        for slot in bucket.slots:
            slot.master.grad = shard[slot.shard_offset:slot.shard_offset + slot.own_numel]
        bucket.finished = True

    def _start_gather(self, bucket: _Bucket):
        """Write this rank's updated segment (cast to the parameters' dtype) into the bucket's persistent buffer and
        start its all-gather into the same buffer (None: one rank, the masters were written into the parameters)."""
        size = bucket.group.mesh.size()
        if size == 1:  # this rank owns the whole parameters: no buffer, no collective
            for slot in bucket.slots:
                if not slot.aliased:  # (an aliased fp32 master is the parameter's own elements: already updated)
                    slot.owned(local_tensor(slot.param)).copy_(slot.master)
            return None
        dtype = local_tensor(bucket.slots[0].param).dtype
        gathered, mine = self.buffers.views(bucket.buffer, size, bucket.segment, dtype)
        for slot in bucket.slots:
            mine[slot.shard_offset:slot.shard_offset + slot.own_numel].copy_(slot.master)
        mine[bucket.held:].zero_()  # (the padding tail: sent, never read)
        return all_gather_single(gathered.view(-1), mine, group=bucket.group.mesh.get_group(), async_op=True)

    def _finish_gather(self, bucket: _Bucket, work) -> None:
        """Wait for a bucket's all-gather and copy the gathered parameters, end to end, into the whole ones."""
        if work is None:
            return
        work.wait()
        dtype = local_tensor(bucket.slots[0].param).dtype
        gathered, _ = self.buffers.views(bucket.buffer, bucket.group.mesh.size(), bucket.segment, dtype)
        flat = gathered.view(-1)
        for slot in bucket.slots:
            local_tensor(slot.param).view(-1).copy_(flat[slot.offset:slot.offset + slot.numel])

    # --- views for checkpoints and tests ------------------------------------------------------
    def _each_state(self):
        for bucket in self.buckets:
            for slot in bucket.slots:
                yield slot, bucket, self.inner.state[slot.master]

    def state_dict(self) -> dict[str, object]:
        """Flattened, keyed by parameter name, moments (and bf16 runs' fp32 masters) of the parameters' global
        shapes, of which this rank holds its flat ranges (FlatRangeTensor: views of the live state)."""
        out: dict[str, object] = {}
        # bf16 parameters: the fp32 masters hold more than the parameters (fp32 copies do not)
        separate_master = self.plan.compute_dtype != torch.float32
        for slot, _, state in self._each_state():
            out[f"state.{slot.name}.step"] = state["step"]
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"state.{slot.name}.{key}"] = checkpoint_view(slot, state[key])
            if separate_master:  # bf16 parameters: the fp32 master weights are state of their own
                out[f"state.{slot.name}.master"] = checkpoint_view(slot, slot.master)
            for key, value in self._group_of[id(slot.master)].items():
                if key != "params":
                    out[f"param_groups.{slot.name}.{key}"] = value
        return out

    def master_weight_keys(self) -> dict[str, str]:
        """state_dict() keys of separate fp32 master weights (bf16 parameters), each with its parameter's name."""
        if self.plan.compute_dtype == torch.float32:
            return {}
        return {f"state.{slot.name}.master": slot.name for slot, _, _ in self._each_state()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        """Copy a (DCP-loaded) state_dict() into the optimizer; masters missing from it are taken from the
        loaded whole parameters (CheckpointManager fills them from a checkpoint's fp32 parameters first).
        A state_dict() loaded in place already holds the live state: nothing is copied twice."""
        for slot, _, state in self._each_state():
            state["step"].copy_(torch.as_tensor(state_dict[f"state.{slot.name}.step"]))
            for key in ("exp_avg", "exp_avg_sq"):
                _copy_range(state[key], state_dict[f"state.{slot.name}.{key}"])
            master = state_dict.get(f"state.{slot.name}.master")
            if master is not None:
                _copy_range(slot.master, master)
            elif not slot.aliased:  # no saved masters: take them from the loaded (whole) parameters
                slot.master.copy_(slot.owned(local_tensor(slot.param)))
            group = self._group_of[id(slot.master)]
            for key in group:
                if key != "params" and f"param_groups.{slot.name}.{key}" in state_dict:
                    group[key] = state_dict[f"param_groups.{slot.name}.{key}"]

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced (and clipped) gradient, whole, by single-process name. Collective."""
        self._reduce_all()
        out = {}
        with warnings.catch_warnings():  # (DTensor's full_tensor may warn about uneven shards: a test helper)
            warnings.simplefilter("ignore", UserWarning)
            for bucket in self.buckets:
                size = bucket.group.mesh.size()
                whole = bucket.grad_shard  # (one rank: the shard is the whole bucket)
                if size > 1:
                    whole = torch.empty(size * bucket.segment, dtype=torch.float32, device=self._device)
                    all_gather_single(whole, bucket.grad_shard, group=bucket.group.mesh.get_group())
                for slot in bucket.slots:
                    local = whole[slot.offset:slot.offset + slot.numel].view(local_tensor(slot.param).shape)
                    param = slot.param
                    if isinstance(param, DTensor):
                        local = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                                   stride=param.stride(), run_check=False).full_tensor()
                    out[slot.name] = local.clone()
        return out

    def gradient_bytes(self) -> int:
        """Bytes of gradient memory this rank holds now: whole parameter gradients (zero1 until the step) and
        the fp32 shards (persistent once allocated). Reduce-scatters pack into buffer_bytes()."""
        held = [local_tensor(p.grad) for p in self._slots if p.grad is not None]
        held += [bucket.shard for bucket in self.buckets if bucket.shard is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def buffer_bytes(self) -> int:
        """Bytes of the persistent communication buffers allocated so far (optim/buffers.py: about two buckets'
        reduce-scatter input and output, reused for the all-gathers)."""
        return self.buffers.allocated_bytes()

    def state_numel(self) -> dict[str, int]:
        """Optimizer-state elements on this rank by kind: fp32 moments plus separate fp32 master copies."""
        counts = {"non_expert": 0, "expert": 0}
        for slot, bucket, state in self._each_state():
            numel = state["exp_avg"].numel() + state["exp_avg_sq"].numel()
            if not slot.aliased:
                numel += slot.master.numel()
            counts[bucket.group.kind] += numel
        return counts


def _copy_range(target: torch.Tensor, value: object) -> None:
    """A loaded state entry (FlatRangeTensor over this rank's range) into the live 1-D `target`."""
    source = value.local() if isinstance(value, FlatRangeTensor) else torch.as_tensor(value).reshape(-1)
    if source.data_ptr() != target.data_ptr() or source.numel() != target.numel():
        target.copy_(source)
