"""Pipeline parallelism with torch.distributed.pipelining: stage split, schedules, the MoE aux losses.

`apply_pipeline` keeps, on each pp rank, only the blocks of its stages (plus the embedding on the first
stage, the final norm and LM head on the last) in the model itself, so parameter names, optimizer
state and DCP checkpoints keep their single-process names and reshard across layouts. The stages are
`PipelineStageModule`s: views sharing those submodules, each a forward for one stage, driven by a
schedule (GPipe, 1F1B, interleaved 1F1B with virtual stages in the loop order: rank r holds stages
r, r + pp, r + 2 pp, ...). The runtime hangs off the model as `model.pipeline` (a plain attribute,
not a submodule); `optimus.train.step.train_step` uses it when present.

MoE aux losses across stages: the single-process objective of one micro-batch is
ce + aux_coef * aux + z_coef * z, with aux and z summed over all layers (divided by n_layers) and the
step's objective the mean over n micro-batches. Each stage adds its own layers' aux/z terms through
`_InjectAuxLoss`, an identity on the stage output whose backward also hands d(objective)/d(aux) =
aux_coef / n (and the same for z) to the stage's layers when the output gradient arrives (Megatron's
aux-loss scaler). Summed over stages and micro-batches this is exactly the single-process gradient.
The values are recorded per stage and summed over the pp ranks for logging.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from optimus.models.layers import rotary_cos_sin
from optimus.models.moe import combine_router_stats, training_objective
from optimus.models.transformer import Transformer
from optimus.parallel.validate import check_pipeline_micro_batches

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # parallel.pp_schedule


def _pipelining():
    """torch.distributed.pipelining, imported where a pipeline is built: it imports torch._dynamo, about a second
    of every process's start-up (each rank's, each CLI command's) that a run without pp does not need."""
    from torch.distributed import pipelining

    return pipelining


def schedule_class(name: str) -> type:
    """torch's schedule class for parallel.pp_schedule `name`."""
    pipelining = _pipelining()
    return {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
            "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B}[name]


class _InjectAuxLoss(torch.autograd.Function):
    """Identity on h; backward also gives aux and z the constant gradients aux_scale and z_scale."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, aux: torch.Tensor, z: torch.Tensor, aux_scale: float, z_scale: float):
        ctx.scales = (aux_scale, z_scale)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_scale, z_scale = ctx.scales
        return grad, torch.full((), aux_scale, device=grad.device), torch.full((), z_scale, device=grad.device), None, None


def rank_layer_keys(n_layers: int, pp: int, virtual_stages: int, rank: int) -> tuple[list[int], list[list[str]]]:
    """(the stages pipeline rank `rank` runs, in loop order: rank, rank + pp, ...; their layer keys)."""
    keys = split_layers(n_layers, pp * virtual_stages)
    stage_ids = [rank + k * pp for k in range(virtual_stages)]
    return stage_ids, [keys[s] for s in stage_ids]


def rank_layers(n_layers: int, pp: int, virtual_stages: int, rank: int) -> list[int]:
    """The indices of the layers pipeline rank `rank` holds (its virtual stages' contiguous chunks)."""
    return [int(key) for keys in rank_layer_keys(n_layers, pp, virtual_stages, rank)[1] for key in keys]


def split_layers(n_layers: int, n_stages: int) -> list[list[str]]:
    """Layer keys per stage, contiguous and as even as possible (earlier stages take the remainder)."""
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} pipeline stages need at least as many layers (model has {n_layers})")
    base, extra = divmod(n_layers, n_stages)
    keys, start = [], 0
    for stage in range(n_stages):
        size = base + (1 if stage < extra else 0)
        keys.append([str(i) for i in range(start, start + size)])
        start += size
    return keys


class PipelineStageModule(nn.Module):
    """One pipeline stage of a Transformer: shares its blocks (and embed / norm + lm_head if first / last).

    forward: token ids (first stage) or hidden states [B, S, D] -> hidden states; on the last stage, given
    labels [B, S], the mean cross-entropy through the fused LM head (no full logits, as Transformer.forward),
    else the logits. The loss is computed inside forward so FSDP has the head's weight gathered.
    """

    def __init__(self, model: Transformer, layer_keys: list[str], is_first: bool, is_last: bool):
        super().__init__()
        self.config = model.config
        self.embed = model.embed if is_first else None
        self.layers = nn.ModuleDict({key: model.layers[key] for key in layer_keys})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.loss_scale = 1.0  # 1 / micro-batches of the current step, set by the runtime
        self.seq_len: int | None = None  # full sequence length (a later stage may get sequence shards under SP)
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (aux, z, counts) per micro-batch

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        cfg = self.config
        cos, sin = rotary_cos_sin(self.seq_len or h.shape[1], cfg.head_dim, cfg.rope_theta, h.device, h.dtype)
        stats = []
        for block in self.layers.values():
            h, layer_stats = block(h, cos, sin)
            if layer_stats is not None:
                stats.append(layer_stats)
        if stats:
            total = combine_router_stats(stats, cfg.n_layers)
            aux, z, counts = total.aux_loss, total.z_loss, total.expert_counts
            if torch.is_grad_enabled():  # training forward: the backward will carry the aux terms
                self.records.append((aux.detach(), z.detach(), counts))
                h = _InjectAuxLoss.apply(h, aux, z, cfg.aux_loss_coef * self.loss_scale, cfg.z_loss_coef * self.loss_scale)
        if self.lm_head is None:
            return h
        h = self.norm(h)
        if labels is None:
            return self.lm_head(h)
        return self.lm_head.cross_entropy(h, labels)


class PipelineRuntime:
    """This rank's stages, their schedule (built per micro-batch count) and the pp mesh."""

    def __init__(self, model: Transformer, stages: list[PipelineStageModule], stage_ids: list[int], n_stages: int,
                 pp_mesh: DeviceMesh, schedule: str, device: torch.device | None):
        self.config = model.config
        self.stages, self.stage_ids, self.n_stages = stages, stage_ids, n_stages
        self.pp_mesh, self.schedule_name, self.device = pp_mesh, schedule, device
        self.has_first, self.has_last = 0 in stage_ids, n_stages - 1 in stage_ids
        self._schedules: dict[int, object] = {}
        self._n_microbatches = 1

    def refresh_layers(self, model: Transformer) -> None:
        """Point the stages at model's current blocks (after activation checkpointing wrapped them), embedding
        and LM head (tensor parallelism swaps in vocabulary-parallel ones)."""
        for stage in self.stages:
            for key in list(stage.layers.keys()):
                stage.layers[key] = model.layers[key]
            if stage.lm_head is not None:
                stage.lm_head = model.lm_head
            if stage.embed is not None:
                stage.embed = model.embed

    def _loss(self, ce: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the last stage's output is already the micro-batch's mean cross-entropy (its labels came as a
        # forward kwarg); pre-divided by n, gradients accumulate to the batch mean
        return ce / self._n_microbatches

    def schedule(self, n_microbatches: int):
        """The schedule for n micro-batches per step (built once per n)."""
        # validate_layout refuses such counts before training starts; a direct caller gets the same line
        check_pipeline_micro_batches(self.schedule_name, self.pp_mesh.size(), n_microbatches)
        if n_microbatches not in self._schedules:
            group = self.pp_mesh.get_group()
            # the device of the weights now (a model built on meta is materialised after apply_pipeline)
            device = self.device or next(self.stages[0].parameters()).device
            pipe_stages = [
                _pipelining().PipelineStage(module, sid, self.n_stages, device, group=group)
                for module, sid in zip(self.stages, self.stage_ids)
            ]
            cls = schedule_class(self.schedule_name)
            stage_arg = pipe_stages if self.schedule_name == "interleaved_1f1b" else pipe_stages[0]
            self._schedules[n_microbatches] = cls(stage_arg, n_microbatches, loss_fn=self._loss, scale_grads=False)
        return self._schedules[n_microbatches]

    def forward_backward(self, micro_batches, device: torch.device, autocast) -> dict[str, torch.Tensor]:
        """One step's forward and backward over micro-batches through the schedule; returns the batch-mean
        loss terms (and summed expert counts), identical on every pp rank, as train_step's forward_backward."""
        n = len(micro_batches)
        self._n_microbatches = n
        for stage in self.stages:
            stage.loss_scale, stage.records, stage.seq_len = 1.0 / n, [], micro_batches[0][0].shape[1]
        inputs = torch.cat([mb[0] for mb in micro_batches]).to(device)
        labels = torch.cat([mb[1] for mb in micro_batches]).to(device)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        # the labels go to this rank's stages' forward too (split per micro-batch like the target):
        # the last stage computes the loss in its forward
        kwargs = {"labels": labels} if self.has_last else {}
        with autocast, warnings.catch_warnings():
            # A MoE stage's output is _InjectAuxLoss's h.view_as(h) (autograd makes an identity's output a view),
            # and FSDP2 warns, once a rank, that an in-place op on a view output would skip its pre-backward hook.
            # The schedule only sends that output or runs backward from it, never writes it in place.
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            self.schedule(n).step(*args, target=labels, losses=losses, return_outputs=False, **kwargs)
        return self._gather_terms(losses, n, device)

    @torch.no_grad()
    def evaluate_loss(self, batches, device: torch.device, autocast, dp_group=None) -> float:
        """Token-weighted mean cross-entropy over (inputs, labels) batches, forward only, on every pp rank; with
        `dp_group`, over every data-parallel replica's batches (each holding its share of the set).

        Hidden states go from stage to stage with plain send/recv (a small header first: their shape
        differs under sequence parallelism), one batch at a time: evaluation is rare, simplicity wins.
        """
        group, pp = self.pp_mesh.get_group(), self.pp_mesh.size()
        owner = {sid: sid % pp for sid in range(self.n_stages)}  # the loop order of apply_pipeline
        modules = dict(zip(self.stage_ids, self.stages))
        # on the device: the pp group's backend (NCCL on GPUs) reduces device tensors only
        total = torch.zeros(2, dtype=torch.float64, device=device)  # nats, tokens
        for inputs, labels in batches:
            inputs, labels = inputs.to(device), labels.to(device)
            h = None
            for sid in range(self.n_stages):
                if sid not in modules:
                    continue
                if sid > 0 and owner[sid - 1] != owner[sid]:
                    h = _recv_tensor(dist.get_global_rank(group, owner[sid - 1]), group, device)
                module = modules[sid]
                module.seq_len = inputs.shape[1]
                with autocast:
                    h = module(inputs if sid == 0 else h, labels=labels if sid == self.n_stages - 1 else None)
                if sid < self.n_stages - 1 and owner[sid + 1] != owner[sid]:
                    _send_tensor(h, dist.get_global_rank(group, owner[sid + 1]), group)
            if self.has_last:  # h is the last stage's mean cross-entropy
                total[0] += h.detach().double() * labels.numel()
                total[1] += labels.numel()
        dist.all_reduce(total, group=group)
        if dp_group is not None:
            dist.all_reduce(total, group=dp_group)
        return (total[0] / total[1].clamp(min=1)).item()

    def _gather_terms(self, losses: list[torch.Tensor], n: int, device: torch.device) -> dict[str, torch.Tensor]:
        cfg = self.config
        # packed: [ce, aux, z, counts of every layer (zeros for layers on other stages)], all on the device:
        # one all-reduce on the pp group (NCCL on GPUs takes device tensors only), no host sync
        counts = torch.zeros(cfg.n_layers, max(cfg.n_experts, 1), dtype=torch.float64, device=device)
        aux = z = torch.zeros((), dtype=torch.float64, device=device)
        for stage in self.stages:
            keys = [int(k) for k in stage.layers]
            # the last n: on its first step the schedule runs one extra forward to infer shapes
            for rec_aux, rec_z, rec_counts in stage.records[-n:]:
                aux, z = aux + rec_aux.double() / n, z + rec_z.double() / n
                counts[keys] += rec_counts.double()
        ce = (torch.stack([loss.detach().double() for loss in losses]).sum() if losses
              else torch.zeros((), dtype=torch.float64, device=device))
        packed = torch.cat([torch.stack([ce, aux, z]), counts.flatten()])
        dist.all_reduce(packed, group=self.pp_mesh.get_group())
        ce, aux, z = packed[0].float(), packed[1].float(), packed[2].float()
        sums = {"ce_loss": ce, "loss": ce}
        if cfg.is_moe:
            sums.update(loss=training_objective(ce, aux, z, cfg), aux_loss=aux, z_loss=z)
            sums["expert_counts"] = packed[3:].view(cfg.n_layers, cfg.n_experts).round().long()
        return sums


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _send_tensor(x: torch.Tensor, dst: int, group) -> None:
    header = torch.zeros(8, dtype=torch.int64)  # dtype index, ndim, shape (ndim <= 6)
    header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
    header[2 : 2 + x.dim()] = torch.tensor(x.shape)
    header = header.to(x.device)
    dist.send(header, dst, group=group)
    dist.send(x.contiguous(), dst, group=group)


def _recv_tensor(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    header = header.cpu()
    shape = header[2 : 2 + int(header[1])].tolist()
    x = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
    dist.recv(x, src, group=group)
    return x


def get_pipeline(model: nn.Module) -> PipelineRuntime | None:
    """The pipeline runtime `apply_pipeline` attached to model, or None when not pipelined."""
    return getattr(model, "pipeline", None)


def apply_pipeline(model: Transformer, pp_mesh: DeviceMesh, schedule: str = "1f1b", virtual_stages: int = 1,
                   device: torch.device | str | None = None) -> Transformer:
    """Keep only this pp rank's stages in `model` (in place) and attach their runtime as model.pipeline.

    pp_mesh is mesh["pp"]. gpipe and 1f1b take one stage per rank; interleaved_1f1b takes
    `virtual_stages` >= 2 per rank. Apply first, before tp, ep, activation checkpointing, compile, fsdp;
    after activation checkpointing call `model.pipeline.refresh_layers(model)`, and give FSDP the stage
    modules (`model.pipeline.stages`) as roots: the schedule calls their forward, never model's.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule must be one of {sorted(SCHEDULES)}, got '{schedule}'")
    if schedule != "interleaved_1f1b" and virtual_stages != 1:
        raise ValueError(f"parallel.pp_virtual_stages > 1 needs pp_schedule=interleaved_1f1b (got {schedule})")
    if schedule == "interleaved_1f1b" and virtual_stages < 2:
        raise ValueError("pp_schedule=interleaved_1f1b needs parallel.pp_virtual_stages >= 2")
    device = torch.device(device) if device is not None else None  # None: the weights' device at the first step
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    n_stages = pp * virtual_stages
    stage_ids, stage_keys = rank_layer_keys(model.config.n_layers, pp, virtual_stages, rank)
    stages = [PipelineStageModule(model, keys, s == 0, s == n_stages - 1) for s, keys in zip(stage_ids, stage_keys)]
    mine = {key for keys in stage_keys for key in keys}
    for key in list(model.layers.keys()):
        if key not in mine:
            del model.layers[key]
    if 0 not in stage_ids:
        model.embed = None
    if n_stages - 1 not in stage_ids:
        model.norm = None
        model.lm_head = None
    model.pipeline = PipelineRuntime(model, stages, stage_ids, n_stages, pp_mesh, schedule, device)
    return model
