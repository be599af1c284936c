"""Data parallelism: FSDP2 (ZeRO-3) over dp_shard, HSDP when dp_replicate > 1; or plain DDP.

`fully_shard` is applied per transformer block, then to the root, so each block's weights are
all-gathered just before it runs and freed after (reshard_after_forward), and its gradients are
reduce-scattered as soon as its backward is done. The root's own weights (embedding, final norm,
LM head) and the last block's (its experts' too) stay gathered from their forward to their
backward. The module tree and parameter names are not changed, so checkpoints (DCP) and the
single-process model share keys.

Mixed precision (train.dtype == "bf16"): MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32).
The sharded parameters and optimizer state stay fp32 (the master weights); FSDP casts them to
bf16 when it gathers them, which halves all-gather traffic and the unsharded weights' memory,
and reduces gradients in fp32 so summing over many ranks loses nothing, unless
parallel.grad_reduce_dtype is bf16 (reduce_dtype=bf16: half the reduce-scatter's bytes, the sums
rounded; the sharded gradients are fp32 again for the optimizer). The same policy is used
on CPU: it ran within 1e-3 of one process there (see CPU-NOTES), and one code path for every
device is worth more than the small extra rounding compared with fp32 params + autocast alone.

parallel.shard_mode=ddp (`apply_ddp`): nothing sharded. Every data-parallel rank holds the whole
model, its gradients and its optimizer state, and gradients are all-reduced in buckets as backward
produces them (torch DDP). For small models on few ranks it moves the fewest bytes (one all-reduce
of the gradients per step, no parameter all-gathers) and has no per-block hooks on the forward.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from optimus.models.moe import MoE


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.dtype (resolved), grad_reduce_dtype


def mixed_precision_policy(dtype: str, reduce_dtype: str = "fp32") -> MixedPrecisionPolicy:
    """Compute in `dtype` ('bf16': weights gathered in bf16), reduce gradients in `reduce_dtype` (fp32 or bf16)."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"training dtype {dtype!r} is not resolved: pass 'fp32' or 'bf16' (choose_precision)")
    return MixedPrecisionPolicy(param_dtype=TORCH_DTYPES["bf16"] if dtype == "bf16" else None,
                                reduce_dtype=TORCH_DTYPES[reduce_dtype])


def _expert_shard_dim(shard_ranks: int, param: torch.Tensor) -> Shard:
    """Shard expert weights along the expert dim when it divides evenly, else along dim 1 if that does.

    FSDP pads uneven shards on dim 0: 8 experts per ep rank over 32 FSDP ranks would be padded to
    one expert per rank, 4x the memory. FSDP supports only even shards on other dims, so dim 1
    ([E, D, 2F] and [E, F, D]) is used only when it divides; otherwise dim 0, padded.
    """
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.shape[0] % shard_ranks and local.shape[1] % shard_ranks == 0:
        return Shard(1)
    return Shard(0)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    dtype: str = "fp32",
    reduce_dtype: str = "fp32",
    experts_mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    ignore_experts: bool = False,
) -> nn.Module:
    """Shard `model` with FSDP2 over `dp_mesh` (1-D: ZeRO-3; 2-D (replicate, shard): HSDP), in place.

    experts_mesh: when expert parallelism is on, MoE expert weights are already split over ep, and
    are sharded by FSDP over this other mesh (dp_shard_mod_ep, or (dp_replicate, dp_shard_mod_ep)).
    They get their own FSDP group, applied before their block's.
    FSDP averages expert gradients over experts_mesh only, though their tokens came from every
    data-parallel rank: expert_parallel.py scales them by 1/ep in the forward, so plain averaging is
    exact (a gradient divide factor would need PREMUL_SUM, which gloo lacks).
    ignore_experts: with an experts_mesh of one rank there is nothing to shard or average: leave the
    expert weights (DTensors over ep already) out of FSDP (ignored_params) instead of giving them a
    group of their own. Op-level selective checkpointing needs this: a one-rank FSDP group unshards
    differently in forward and in the recompute, which that policy's op replay refuses.
    Works on the meta device too (dry runs): shapes and placements are real, no memory is used.
    """
    policy = mixed_precision_policy(dtype, reduce_dtype)
    blocks = list(model.layers.values()) if hasattr(model, "layers") else []
    ignored = None
    if ignore_experts and experts_mesh is not None:
        if experts_mesh.size() != 1:
            raise ValueError("ignore_experts needs an experts_mesh of one rank (nothing to average over)")
        ignored = {p for block in blocks if isinstance(getattr(block, "mlp", None), MoE)
                   for p in block.mlp.experts.parameters()}
    for index, block in enumerate(blocks):
        # The last block's weights (its experts' too) are needed again at once by backward: keep them gathered.
        reshard = reshard_after_forward and index < len(blocks) - 1
        moe = getattr(block, "mlp", None)
        if experts_mesh is not None and isinstance(moe, MoE) and ignored is None:
            fully_shard(moe.experts, mesh=experts_mesh, mp_policy=policy, reshard_after_forward=reshard,
                        shard_placement_fn=partial(_expert_shard_dim, experts_mesh.size()))
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard, ignored_params=ignored)
    # The root's own weights (embedding, final norm, LM head) are the last the forward uses and the first the
    # backward needs: keep them gathered between the two (torch's own choice for a root left to its default;
    # resharding it re-gathered the embedding and head once more every step).
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False, ignored_params=ignored)
    return model


DDP_BUCKET_CAP_MB = 25  # torch DDP's default gradient bucket; its first bucket is 1 MiB (what plan/ prices)
DDP_FIRST_BUCKET_BYTES = 2 ** 20


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, bucket_cap_mb: int = DDP_BUCKET_CAP_MB,
              reduce_dtype: str = "fp32") -> nn.Module:
    """Replicate `model` over `dp_mesh` with torch DDP (the composable `replicate`, as torchtitan), in place.

    Parameters stay plain whole tensors with unchanged names (no `module.` prefix: checkpoints keep
    the single-process keys, so DCP reshards them into FSDP or zero runs and back). Gradients are
    averaged over dp_mesh in buckets of bucket_cap_mb (DDP's default) while backward runs. DDP itself
    is built at the first forward (after the weights are materialised) and starts by broadcasting
    rank 0's weights. Every parameter must get a gradient in every backward (no find_unused_parameters).
    Pure data parallelism only: validate.check_shard_mode refuses tp, pp or ep with it.
    reduce_dtype "bf16": each bucket is all-reduced in bf16 (bf16_all_reduce_hook: cast, divided by the ranks,
    summed, cast back into the fp32 bucket), half the bytes.
    """
    from torch.distributed._composable.replicate import replicate

    replicate(model, process_group=dp_mesh.get_group(), bucket_cap_mb=bucket_cap_mb)
    if reduce_dtype == "bf16":
        model.register_comm_hook(dp_mesh.get_group(), bf16_all_reduce_hook)
    return model


def bf16_all_reduce_hook(group, bucket):  # (no return annotation: DDP compares it with the real type, and this
    # module's annotations are strings)
    """A DDP comm hook: the bucket's gradients averaged over `group` in bf16, written back into the bucket (a
    Future of it).

    torch's own bf16_compress_hook does the same but DDP refuses it by name unless the backend is NCCL or XCCL;
    this one runs on every backend (gloo sums bf16). Divided before the sum, as torch's hook: bf16 keeps fp32's
    range, so the order only changes the rounding."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    reduced = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(future: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(future.value()[0])
        return buffer

    return reduced.then(decompress)


def is_ddp(model: nn.Module) -> bool:
    """Whether `model` was replicated by apply_ddp."""
    from torch.distributed._composable.replicate import DDP

    return isinstance(model, DDP)


def set_gradient_sync(model: nn.Module, last_micro_batch: bool, defer: str = "replicate") -> None:
    """Before a micro-batch's backward: whether FSDP reduces gradients now or lets them accumulate.

    defer="none": reduce-scatter (and HSDP's all-reduce) after every micro-batch's backward.
    "replicate" (default): reduce-scatter every micro-batch, so accumulated gradients stay sharded
    (no memory cost), but all-reduce over dp_replicate only after the last: HSDP's slow inter-node
    traffic once per step. "all": neither until the last micro-batch; meanwhile each rank holds the
    unsharded gradients of its FSDP units (more memory, fewest bytes moved). A model without FSDP
    (one rank, TP only) is left alone; pipeline stages defer by themselves (torch's schedules).
    DDP (apply_ddp): every dp rank is a replica and gradients are whole anyway, so "replicate" and
    "all" both all-reduce once per step, after the last micro-batch's backward (DDP's no_sync).
    """
    if defer == "none":
        return
    if is_ddp(model):
        model.set_requires_gradient_sync(last_micro_batch)
        return
    if not isinstance(model, FSDPModule):
        return
    if defer == "replicate":
        model.set_requires_all_reduce(last_micro_batch, recurse=True)
    else:
        model.set_requires_gradient_sync(last_micro_batch, recurse=True)
