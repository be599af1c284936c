"""Fields of a logged step's record beyond the step's own losses: throughput and MFU (with how the
peak was obtained, once), each rank's peak memory, and the routers' load per MoE layer."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from optimus.train.callbacks.base import Callback
from optimus.train.metrics import (Throughput, busiest_block_share, expert_counts_record, expert_load_summary,
                                   peak_memory_bytes)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from optimus.train.trainer import Trainer

GIB = 2**30


class ThroughputMetrics(Callback):
    """tokens_per_s, tokens_per_s_per_device and mfu over the steps since the last logged one; the first
    logged row of a run segment also says how they were obtained (precision, peak, world size)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.meter = Throughput(trainer.flops_per_token, trainer.peak_flops, replicas=trainer.dims.dp,
                                world_size=trainer.dims.world_size)
        self._warned_impossible_mfu = False
        self._logged_first_row = False
        self._window_started = False

    def on_step_start(self, step: int) -> None:
        if not self._window_started:  # the first step: not construction, nor the other callbacks' start-up
            self._window_started = True
            self.meter.report()

    def on_step_result(self, step: int, result: Any) -> bool:
        self.meter.add(result.tokens)
        return False

    def on_log(self, step: int, result: Any, record: dict[str, Any]) -> None:
        trainer = self.trainer
        throughput = self.meter.report()
        if throughput.impossible_mfu is not None and not self._warned_impossible_mfu:
            self._warned_impossible_mfu = True
            if trainer.is_rank0:
                print(f"warning: MFU computed as {100 * throughput.impossible_mfu:.0f}%, above 100%: the peak of "
                      f"{trainer.peak_flops / 1e12:.4g} TFLOP/s ({trainer.peak_source}) is too low, so MFU is not "
                      f"reported", file=sys.stderr, flush=True)
        record.update(tokens_per_s=throughput.tokens_per_s, tokens_per_s_per_device=throughput.tokens_per_s_per_device,
                      mfu=throughput.mfu)
        if not self._logged_first_row:
            # how the figures above were obtained, once per run segment: the first row of metrics.jsonl
            self._logged_first_row = True
            precision = trainer.precision
            record.update(dtype=precision.dtype, dtype_requested=precision.requested, dtype_reason=precision.reason,
                          peak_flops_per_device=trainer.peak_flops, peak_source=trainer.peak_source,
                          world_size=trainer.dims.world_size)


class MemoryMetrics(Callback):
    """memory_peak_gib: every rank's peak memory so far, index = rank (one small all-gather per logged
    step, on every rank); the first logged row also names what was measured (memory_source) and the planner's
    predicted peak of tensors per rank (memory_planned_gib: the largest stage's, train/memory_fit.py): a GPU's allocated
    peak is to match it; a CPU's resident set adds the process's own memory."""

    def __init__(self, device: torch.device, planned_peak_bytes: float | None = None):
        self.device = device
        self.planned_peak_bytes = planned_peak_bytes
        self._logged_source = False

    def on_log(self, step: int, result: Any, record: dict[str, Any]) -> None:
        peak, source = peak_memory_bytes(self.device)
        mine = torch.tensor([float(peak)], dtype=torch.float64, device=self.device)
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
        # one device-to-host copy for every rank's value (on a GPU each .item() is a wait of its own)
        record["memory_peak_gib"] = [round(value / GIB, 4) for value in torch.cat(everyone).tolist()]
        if not self._logged_source:
            self._logged_source = True
            record["memory_source"] = source
            if self.planned_peak_bytes is not None:
                record["memory_planned_gib"] = round(self.planned_peak_bytes / GIB, 4)


class ExpertLoadMetrics(Callback):
    """MoE models: expert_load_max / expert_load_min (over all layers, relative to an even split) and
    expert_counts, the tokens routed to each expert of each MoE layer in the step's global batch. Where ep or tp
    split the experts between ranks (`expert_blocks` = ep x tp > 1), also the busiest rank's share of each layer's
    token copies over an even split's: expert_rank_load_max (its worst layer) and expert_rank_load_mean (the
    layers' mean: what a step's expert GEMMs wait for). At the end of the run, `say` gives the mean over the logged
    steps beside the planner's flag that prices it, and the flag that prices any layout's split at the counts this
    run logged in `run_dir` (the planner and the memory check assume even routing).

    Where the data-parallel ranks form several expert-exchange groups (`exchange_groups`: the ep mesh, whose ranks
    exchange tokens, and the expert_dp mesh, one rank of each group), each group's ranks wait for the group's
    busiest, on the group's own tokens, and the groups for the slowest at the gradient sync: the shares are then
    the slowest group's (its layers' mean; the worst group and layer), each group summing its ranks' own counts.
    The global counts would even out what differs between groups (two groups each sending all their copies to
    another half of the experts read 1.0x globally, 2.0x in each group). Every rank calls on_log (collectives)."""

    def __init__(self, expert_blocks: int = 1, say: Callable[[str], None] | None = None,
                 run_dir: Path | None = None, exchange_groups: tuple[DeviceMesh, DeviceMesh] | None = None):
        self.expert_blocks = expert_blocks
        self.say = say
        self.run_dir = run_dir
        self.exchange_groups = exchange_groups
        # over the logged steps (a running total: a long run logs hundreds of thousands of steps)
        self._logged, self._mean_sum, self._worst = 0, 0.0, 0.0

    def on_log(self, step: int, result: Any, record: dict[str, Any]) -> None:
        if result.expert_counts is None:
            return
        counts = result.expert_counts.detach().cpu()  # one copy off the device for every field
        record.update(expert_load_summary(counts))
        record["expert_counts"] = expert_counts_record(counts)
        self._logged += 1
        if self.expert_blocks > 1:
            if self.exchange_groups is not None and result.rank_expert_counts is not None:
                mean, worst = self._slowest_group(result.rank_expert_counts)
            else:
                shares = busiest_block_share(counts, self.expert_blocks)
                mean, worst = shares.mean().item(), shares.max().item()
            record.update(expert_rank_load_mean=round(mean, 4), expert_rank_load_max=round(worst, 4))
            self._mean_sum, self._worst = self._mean_sum + mean, max(self._worst, worst)

    def _slowest_group(self, rank_counts: torch.Tensor) -> tuple[float, float]:
        """(the slowest exchange group's layers' mean of its busiest block share, the largest of any group's
        layer): the group's counts summed over its ep ranks, the two figures' maxima over the groups."""
        ep_mesh, groups_mesh = self.exchange_groups
        group_counts = rank_counts.detach().to(torch.float64, copy=True)  # summed in place: not the step's own
        if ep_mesh.size() > 1:
            dist.all_reduce(group_counts, group=ep_mesh.get_group())
        shares = busiest_block_share(group_counts, self.expert_blocks)
        slowest = torch.stack([shares.mean(), shares.max()])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=groups_mesh.get_group())
        mean, worst = slowest.tolist()
        return mean, worst

    def on_error(self, error: BaseException) -> None:
        self.say = None  # a failed run ends on its error line alone

    def on_train_end(self, step: int) -> None:
        if self.say is None or not self._logged:
            return
        other_splits = f"`--moe-routing {self.run_dir}`" if self.run_dir is not None else None
        if self.expert_blocks == 1:
            if other_splits:
                self.say(f"routing: `optimus plan CONFIG --moe-routing {self.run_dir}` prices every layout at the "
                         f"expert counts this run logged (each at its own split of the experts over ep x tp ranks)")
            return
        mean = self._mean_sum / self._logged
        where = (f" (in the slowest of the {self.exchange_groups[1].size()} exchange groups each step)"
                 if self.exchange_groups is not None else "")
        self.say(f"routing: the busiest of the {self.expert_blocks} expert shards (ep x tp){where} received "
                 f"{mean:.2f}x its even share of a layer's token copies (mean over {self._logged} logged steps; "
                 f"{self._worst:.2f}x in the worst layer); `optimus plan --moe-imbalance {mean:.2f}` prices that"
                 + (f" ({other_splits}: each layout at its own split)" if other_splits else ""))
