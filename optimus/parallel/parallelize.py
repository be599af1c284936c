"""The one ordered entry point that turns a single-device model into its parallel form.

Order (as torchtitan): pipeline split -> tensor parallel -> expert parallel -> activation
checkpointing -> torch.compile -> FSDP. Each step is a function taking the model and the mesh;
each is one clearly separated call below.

Every parallel layout starts from the weights one process would have (`build_parallel_model`):
the model is built on the meta device and parallelized there, each rank allocates only its own
shards and computes their seeded initial values itself (models/init.py draws any slice of a
parameter reproducibly). No process ever holds the whole model and nothing is broadcast.
With device "meta" nothing is allocated: that is the dry run's path.
"""

from __future__ import annotations

import functools
import warnings
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy

from optimus.config import Config
from optimus.models.moe import MoE
from optimus.parallel.mesh import ParallelDims, ParallelMesh


def build_parallel_model(config: Config, dims: ParallelDims, mesh: ParallelMesh | None,
                         device: torch.device | str) -> nn.Module:
    """The Trainer's model: built, parallelized, and holding the single-process initial weights.

    One process: build_model on `device` with the run's seed (the values are drawn on the CPU, so
    they are the same whatever the device), then parallelize_model. Parallel layouts
    (pp included: its stages take their device at the first step): meta build -> parallelize_model ->
    allocate local shards -> each rank computes its shards of the seeded weights (models/init.py).
    device "meta": meta build -> parallelize_model, nothing allocated (dry runs).
    """
    from optimus.models.transformer import build_model

    if str(device) == "meta":
        return parallelize_model(build_model(config.model, device="meta"), dims, mesh, config)
    if mesh is None or not dims.is_parallel or config.parallel.shard_mode == "ddp":
        # ddp replicates the whole (small) model: each rank builds it as one process does
        model = build_model(config.model, device=device, seed=config.train.seed)
        return parallelize_model(model, dims, mesh, config)
    model = parallelize_model(build_model(config.model, device="meta"), dims, mesh, config)
    model.to_empty(device=device)
    load_initial_weights(model, config)
    return model


def load_initial_weights(model: nn.Module, config: Config) -> None:
    """Fill a parallelized, allocated model with the weights build_model(seed) gives one process.

    Every rank computes just its own shard of each parameter (models/init.py draws any slice of a
    parameter reproducibly): no rank holds the full model and nothing is communicated.
    Raises if a parameter's name is not a single-process name (an unknown wrapper prefix).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from optimus.models.init import initial_slice
    from optimus.models.transformer import build_model

    single_process = build_model(config.model, device="meta")
    single_process_names = {name for name, _ in single_process.named_parameters()}
    with torch.no_grad():
        for wrapped_name, param in model.named_parameters():
            name = single_process_name(wrapped_name)
            if name not in single_process_names:
                raise RuntimeError(f"no initial weights for '{wrapped_name}': parallel names must match build_model's")
            std = single_process.initial_std(name)
            if isinstance(param, DTensor):
                size, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                local = param.to_local()
            else:
                size, offset, local = tuple(param.shape), (0,) * param.ndim, param
            local.copy_(initial_slice(config.train.seed, name, tuple(param.shape), std, offset, size))


# Module wrappers that add a level to parameter names (activation checkpointing, torch.compile).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def single_process_name(name: str) -> str:
    """A parameter's name as in the plain single-process model."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def parallelize_model(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh | None, config: Config) -> nn.Module:
    """Apply the configured parallelisms, in order, to `model` (on the meta device or materialised).

    One process: only activation checkpointing and compile (if configured) apply.
    """
    train = config.train
    parallel = mesh is not None and dims.is_parallel

    # 1. pipeline split: this rank keeps its stages' blocks; the stages' runtime is model.pipeline
    pipeline = None
    if parallel and dims.pp > 1:
        from optimus.parallel.pipeline import apply_pipeline

        apply_pipeline(model, mesh["pp"], config.parallel.pp_schedule, config.parallel.pp_virtual_stages)
        pipeline = model.pipeline

    # 2. tensor + sequence parallel
    if parallel and dims.tp > 1:
        from optimus.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True)

    # 3. expert parallel: experts split over mesh["ep"], tokens dispatched to their experts' ranks
    if parallel and dims.ep > 1:
        from optimus.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, mesh["ep"], config.parallel.ep_dispatch)

    # 4. activation checkpointing
    if train.activation_checkpointing != "none":
        from optimus.parallel.validate import check_checkpointing_layout

        check_checkpointing_layout(train.activation_checkpointing, dims)
        apply_activation_checkpointing(model, train.activation_checkpointing, train.recompute)

    # 5. torch.compile, per block (keeps parameter names; FSDP hooks stay outside the graph)
    if train.compile:
        for block in model.layers.values():
            block.compile()
    if pipeline is not None:  # the stages must run the wrapped blocks
        pipeline.refresh_layers(model)

    # 6. FSDP (ZeRO-3 / HSDP) over the data-parallel ranks, when there are several. With none (tp / pp
    # only) it would shard over one rank: a gathered copy of every unit's weights and gradients (the whole
    # stage's under pp) and copies each step, for nothing. tp's DTensor and pp's plain parameters train as
    # they are (the optimizer keeps the two kinds in separate groups: optim/build.py).
    # zero1/zero2 instead keep parameters whole: the optimizer (optim/sharded.py) shards its state
    # and reduces gradients itself; it works on local tensors, so a mix of DTensors is fine there.
    # ddp replicates everything (torch DDP): plain tensors, pure data parallelism only.
    if parallel and config.parallel.shard_mode == "ddp":
        from optimus.parallel.data_parallel import apply_ddp

        # pure data parallel (validate.check_shard_mode): dp is every rank
        apply_ddp(model, mesh["dp"], reduce_dtype=config.parallel.grad_reduce_dtype)
    elif parallel and config.parallel.shard_mode != "fsdp":
        from optimus.optim.sharded import ZeroPlan
        from optimus.parallel.data_parallel import TORCH_DTYPES

        compute = TORCH_DTYPES["bf16" if train.dtype == "bf16" else "fp32"]
        model.zero_plan = ZeroPlan(config.parallel.shard_mode, config.parallel.ep_aware, mesh, compute,
                                   TORCH_DTYPES[config.parallel.grad_reduce_dtype])
    elif parallel and dims.has_data_parallel:
        from optimus.parallel.data_parallel import apply_fsdp

        experts_mesh = None
        if dims.ep > 1:
            experts_mesh = mesh["dp_replicate", "dp_shard_mod_ep"] if dims.dp_replicate > 1 else mesh["dp_shard_mod_ep"]
        # under pp the schedule calls the stage modules, never model: they are FSDP's roots
        for root in pipeline.stages if pipeline is not None else [model]:
            apply_fsdp(
                root, fsdp_mesh(dims, mesh), dtype=train.dtype, reduce_dtype=config.parallel.grad_reduce_dtype,
                experts_mesh=experts_mesh,
                # op-level checkpointing cannot replay a one-rank experts group: leave experts out of FSDP
                ignore_experts=train.activation_checkpointing == "selective_ops" and experts_mesh is not None
                and experts_mesh.size() == 1,
            )
    return model


def fsdp_mesh(dims: ParallelDims, mesh: ParallelMesh):
    """FSDP's mesh: dp_shard (ZeRO-3), or the 2-D (dp_replicate, dp_shard) mesh for HSDP."""
    if dims.dp_replicate == 1:
        return mesh["dp_shard"]
    if dims.ep == 1:  # dp_shard is dp_shard_mod_ep: slice real mesh dims, not a flattened one
        return mesh["dp_replicate", "dp_shard_mod_ep"]
    with warnings.catch_warnings():  # slicing a flattened dim is deprecated; no other way to get the 2-D mesh yet
        warnings.simplefilter("ignore", UserWarning)
        return mesh["dp_replicate", "dp_shard"]


# Ops whose outputs op-level ("selective_ops") checkpointing keeps (the expensive ones to recompute): the matmuls,
# attention, and the experts' grouped GEMMs (ops/experts.py's fused ops: custom ops, not aten's mm; replayed, they
# cost a third of the experts' compute again: the tiny MoE's step 1.05-1.18x slower on the 2-core EPYC); and the
# collectives whose outputs are a rank's own activations, so that the replay communicates as little as it can (as
# torchtitan keeps its all-to-all and reduce-scatter outputs): the EP dispatch and combine, the sequence-parallel
# reduce-scatters (DTensor's, and the experts' under tp) and the partial sums. The all-gathers are replayed: their
# output is tp (ep) x the rows this rank holds, more than the activations their replay recomputes; the routing's
# integer counts are the exception (a few numbers, and a host read each exchange).
@functools.cache
def _kept_collectives() -> frozenset:
    import optimus.parallel.collective_ops  # noqa: F401 (registers the optimus:: collectives)

    optimus_ops, functional = torch.ops.optimus, torch.ops._c10d_functional
    return frozenset({optimus_ops.all_to_all_rows.default, optimus_ops.reduce_scatter_rows.default,
                      optimus_ops.all_reduce_sum.default,
                      functional.reduce_scatter_tensor.default, functional.all_reduce.default})


@functools.cache
def _kept_ops() -> frozenset:
    import optimus.ops.experts  # noqa: F401 (registers the optimus:: expert ops)

    aten, optimus_ops = torch.ops.aten, torch.ops.optimus
    return frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default,
                      aten._scaled_dot_product_flash_attention_for_cpu.default,
                      aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_flash_attention.default,
                      optimus_ops.moe_experts.default, optimus_ops.expert_mlp.default}) | _kept_collectives()


@functools.cache
def _all_gather_rows():
    import optimus.parallel.collective_ops  # noqa: F401

    return torch.ops.optimus.all_gather_rows.default


def _ops_policy(ctx, op, *args, **kwargs):
    # called for every op the block dispatches, forward and replay: set lookups only
    keep = op in _kept_ops() or (op is _all_gather_rows() and not args[0].is_floating_point())
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _recomputed_class(cls: type) -> type:
    """A subclass of `cls` whose forward is checkpointed (isinstance checks and parameter names unchanged)."""
    from torch.utils.checkpoint import checkpoint

    def forward(self, *args, **kwargs):
        # non-reentrant: only the inputs are saved; the forward runs again in backward
        return checkpoint(cls.forward, self, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return type(f"Recomputed{cls.__name__}", (cls,), {"forward": forward, "_recomputed": True})


def recompute_module(module: nn.Module) -> None:
    """Make `module` recompute its forward in backward, in place.

    A class swap, as fully_shard does, rather than checkpoint_wrapper: the module stays an instance of
    its class (Block tells a MoE from a dense MLP by isinstance) and keeps its parameter names, so the
    optimizer, DCP keys and FSDP/TP/EP plans see the same model. Module hooks (TP, FSDP) still run
    outside the checkpointed region.
    """
    if not getattr(module, "_recomputed", False):
        module.__class__ = _recomputed_class(type(module))


def _recomputed_parts(block: nn.Module, recompute: list[str]) -> list[nn.Module]:
    """The sub-modules of one block named by train.recompute ("norms" includes QK-norm unless the whole
    attention is recomputed already)."""
    parts = []
    if "attention" in recompute:
        parts.append(block.attn)
    if "norms" in recompute:
        parts += [block.attn_norm, block.mlp_norm]
        if "attention" not in recompute and block.attn.q_norm is not None:
            parts += [block.attn.q_norm, block.attn.k_norm]
    is_moe = isinstance(block.mlp, MoE)
    if ("moe" in recompute and is_moe) or ("mlp" in recompute and not is_moe):
        parts.append(block.mlp)
    return parts


def apply_activation_checkpointing(model: nn.Module, mode: str, recompute: list[str] | tuple[str, ...] = ("moe",)) -> None:
    """Activation checkpointing per block, in place.

    full: each block recomputes its whole forward in backward (checkpoint_wrapper; DCP strips its prefix).
    selective: inside every block, only the sub-modules named in `recompute` ("attention", "moe", "mlp"
        (the dense SwiGLU), "norms") keep just their inputs and are recomputed; the rest keeps its
        activations. Plain checkpointing like full, so it composes with FSDP, TP, EP and PP.
    selective_ops: op-level selective checkpointing of each block: the outputs of matmuls, attention, the fused
        expert ops (their grouped GEMMs) and the collectives but the all-gathers are kept (_kept_ops), the cheap
        ops (norms, activations, the all-gathers) replayed. Its replay needs every FSDP group in a block to
        unshard alike in forward and recompute: see apply_fsdp's ignore_experts.
    """
    if mode == "selective":
        for block in model.layers.values():
            for part in _recomputed_parts(block, list(recompute)):
                recompute_module(part)
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    kwargs = {"preserve_rng_state": False}
    if mode == "selective_ops":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _ops_policy)
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, **kwargs)
