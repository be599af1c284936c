"""The training loop: build everything from a config, resume if a checkpoint exists, step.

What a step computes lives in step.py. Everything around the step is a callback (callbacks/base.py
lists the hooks and when they are called): the loop's own side concerns (evaluation, checkpointing,
throughput, memory and expert-load metrics, skipped-step guard, straggler report, preemption, hang
watchdog) on every rank, then the reporting ones (metrics.jsonl, console, plots, report, loggers) on rank 0.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from optimus.checkpoint.manager import CheckpointError, CheckpointManager
from optimus.checkpoint.preflight import CHECKPOINT_BYTES_PER_PARAMETER
from optimus.config import Config, ConfigError, config_yaml, save_config
from optimus.data.build import build_training_data
from optimus.models.flops import count_parameters, flops_per_token
from optimus.models.transformer import Transformer, build_model
from optimus.optim.build import build_optimizer, set_lr
from optimus.optim.schedule import lr_at
from optimus.parallel.launch import cpu_speed_cache, detect_launch_env, device_for, init_distributed
from optimus.parallel.parallelize import build_parallel_model
from optimus.parallel.validate import validate_layout
from optimus.resilience.guards import ConsecutiveSkips, LossSpikeGuard
from optimus.resilience.stragglers import StragglerMonitor
from optimus.train.callbacks import Callback, ConsoleProgress, EventLines, JsonlMetrics, LossPlot, RunReport
from optimus.train.callbacks.checkpointing import Checkpointing
from optimus.train.callbacks.evaluation import Evaluation
from optimus.train.callbacks.resilience import HangWatch, PreemptionCheckpoint, SkippedSteps, StragglerReport
from optimus.train.callbacks.step_metrics import ExpertLoadMetrics, MemoryMetrics, ThroughputMetrics
from optimus.train.checkpoint_match import check_checkpoint_matches
from optimus.train.hardware import cpu_speed, device_peak_flops
from optimus.train.host_memory import reuse_freed_host_memory
from optimus.train.memory_fit import check_memory_fits
from optimus.train.precision import Precision, agree_on_precision, choose_precision
from optimus.train.resume_settings import changed_settings, keep_earlier_config, keep_earlier_metrics
from optimus.train.state import LoaderState, ModelState, OptimizerState, ProgressState, RNGState
from optimus.train.step import StepResult, train_step


@dataclass
class TrainSummary:
    run_dir: Path
    step: int
    heldout_loss: float | None
    resumed_from: int | None
    stopped_by_signal: str | None = None  # e.g. "SIGTERM": checkpointed at `step` and stopped early


# The files a run writes beside its checkpoints (a folder under one of these names failed only at the first
# checkpoint, or at the end, after training and after older checkpoints were rotated out).
RUN_FILES = ("config.yaml", "metrics.jsonl", "loss.png", "report.html")


def _check_run_files(run_dir: Path) -> None:
    blocked = [name for name in RUN_FILES if (run_dir / name).is_dir()]
    if blocked:
        raise ConfigError(f"run.dir {run_dir} holds a folder named '{blocked[0]}' where training writes a file: "
                          "move it away, or choose another run.dir")


class Trainer:
    """Owns the model, optimizer, data and checkpoints of one run; `fit()` trains to max_steps."""

    def __init__(self, config: Config, callbacks: list[Callback] | None = None, progress_bar: bool = True):
        self.config = config
        self.run_dir = config.run.path
        launch = detect_launch_env()
        self.device = device_for(launch.local_rank)
        if self.device.type == "cpu" and config.train.reuse_host_memory:  # every step allocates the same large
            reuse_freed_host_memory()  # tensors again: keep their pages
        self.is_rank0 = launch.rank == 0
        # every layout and batch rule, before anything is written; the micro-batch is filled in when derived
        layout = validate_layout(config, launch.world_size)
        self.requested_config = self.config = config = layout.config
        self.dims = layout.dims
        if self.is_rank0 and layout.batch.derived:
            print(layout.batch.describe(), file=sys.stderr, flush=True)
        init_distributed(launch, self.device)
        self.precision, peak, self.peak_source = self._choose_precision(config.train.dtype)
        # The run computes in the resolved dtype; config.yaml keeps what was asked ("auto" stays auto,
        # so the same run resumed on another machine chooses for that machine).
        config = config.model_copy(update={"train": config.train.model_copy(update={"dtype": self.precision.dtype})})
        self.config = config
        # before anything large is allocated: a layout that cannot fit stops here, not at the OOM killer
        self.planned_peak_bytes = (check_memory_fits(config, self.dims, self.device, launch.local_world_size)
                                   if config.train.memory_check else None)
        self.mesh = self.dims.build_mesh(self.device.type) if self.dims.is_parallel else None
        dp_rank = self.mesh.local_rank("dp") if self.mesh else 0
        torch.manual_seed(config.train.seed)
        self.data = build_training_data(config, dp_rank=dp_rank, dp_size=self.dims.dp)
        self.checkpoints = CheckpointManager(self.run_dir, config.train.keep_last_k, device=self.device)
        _check_run_files(self.run_dir)
        # the whole model's count (on meta, free): under PP this rank's model holds only its stages
        params = count_parameters(build_model(config.model, device="meta"), config.model)
        self.checkpoints.preflight(checkpoint_bytes=params.total * CHECKPOINT_BYTES_PER_PARAMETER)
        self.resume_step, skipped = self.checkpoints.newest_usable()  # damaged ones are moved aside, never deleted
        if skipped and self.is_rank0:
            print(f"resuming from step {self.resume_step}: skipped checkpoint {'; '.join(skipped)}",
                  file=sys.stderr, flush=True)
        if self.resume_step is not None:
            check_checkpoint_matches(self.checkpoints.read_meta(self.resume_step), config, self.run_dir)
            if self.resume_step > config.train.max_steps:  # (it trained nothing, said nothing, rewrote config.yaml)
                raise CheckpointError(
                    f"the run in {self.run_dir} is at step {self.resume_step}, past train.max_steps = "
                    f"{config.train.max_steps}: pass --train.max_steps={self.resume_step} or more to go on, or "
                    "another run.dir to start afresh")

        # Every layout starts from the weights one process would have (see build_parallel_model).
        self.model: Transformer = build_parallel_model(config, self.dims, self.mesh, self.device)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.progress = ProgressState()
        self.state = {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "progress": self.progress,
            "loader": LoaderState(self.data.loader),
            "rng": RNGState(),
        }
        r = config.resilience
        self.consecutive_skips = self.state["consecutive_skips"] = ConsecutiveSkips(r.max_consecutive_skips)
        self.spike_guard = LossSpikeGuard(r.spike_zscore, r.spike_window) if r.spike_zscore > 0 else None
        if self.spike_guard is not None:
            self.state["loss_spike_guard"] = self.spike_guard  # an older checkpoint without it starts it empty
        self.flops_per_token = flops_per_token(params, config.model, config.train.seq_len)
        self.peak_flops = peak
        self.stop_reason: str | None = None  # set by a callback that stops the run early (a preemption signal)
        self.callbacks = self._side_concerns(launch.rank, launch.world_size)
        if self.is_rank0:  # reporting callbacks write files and print: rank 0 only
            self.callbacks += callbacks if callbacks is not None else self._default_callbacks(progress_bar)

    def _side_concerns(self, rank: int, world_size: int) -> list[Callback]:
        """The loop's own side concerns, on every rank (their hooks may be collective), in calling order:
        the record's fields, then after a step: the skip guard, a preemption stop, evaluation, checkpoint."""
        r = self.config.resilience
        monitor = (StragglerMonitor(r.straggler_every, r.straggler_factor, self.device)
                   if r.straggler_every and world_size > 1 else None)
        self.straggler_report = StragglerReport(monitor)
        self.evaluation = Evaluation(self)
        self.checkpointing = Checkpointing(self)
        side: list[Callback] = [
            self.straggler_report, ThroughputMetrics(self), MemoryMetrics(self.device, self.planned_peak_bytes),
            ExpertLoadMetrics(self.dims.ep * self.dims.tp, self._say, self.run_dir, self._exchange_groups()),
            SkippedSteps(self.consecutive_skips, self.spike_guard),
        ]
        if r.checkpoint_on_signal:
            side.append(PreemptionCheckpoint(self))
        if r.hang_timeout_s > 0:
            side.append(HangWatch(r.hang_timeout_s, rank))
        return side + [self.evaluation, self.checkpointing]

    @property
    def stragglers(self) -> StragglerMonitor | None:
        """The straggler monitor (None: one process, or resilience.straggler_every=0)."""
        return self.straggler_report.monitor

    @stragglers.setter
    def stragglers(self, monitor) -> None:
        self.straggler_report.monitor = monitor

    def _default_callbacks(self, progress_bar: bool) -> list[Callback]:
        callbacks: list[Callback] = [JsonlMetrics(self.run_dir / "metrics.jsonl"), EventLines()]
        if self.config.train.loss_plot:
            callbacks.insert(1, LossPlot(self.run_dir))  # after JsonlMetrics: it plots what that one wrote
        if progress_bar:
            callbacks.insert(0, ConsoleProgress())
        if self.config.train.tensorboard:
            from optimus.train.callbacks.tensorboard import TensorBoardLogger

            callbacks.append(TensorBoardLogger(self.run_dir / "tensorboard"))
        if self.config.train.wandb is not None:
            from optimus.train.callbacks.wandb import WandbLogger

            callbacks.append(WandbLogger(self.config.train.wandb, self.requested_config, self.run_dir))
        if self.config.train.report:
            callbacks.append(RunReport(self.run_dir, written_unless=lambda: self.stop_reason is not None))
        return callbacks

    def dispatch(self, hook: str, *args) -> None:
        """Call `hook` of every callback, in order."""
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def stop(self, reason: str) -> None:
        """End the run after the current step's side work (a callback's request, e.g. on a preemption signal)."""
        self.stop_reason = reason

    def _choose_precision(self, requested: str) -> tuple[Precision, float, str]:
        """(training precision, peak FLOP/s of this device in it, the peak's source)."""
        cpu = None
        if self.device.type == "cpu":
            cache_file, kernel_env = cpu_speed_cache()
            cpu = cpu_speed(cache_file, kernel_env)
        precision = agree_on_precision(choose_precision(requested, self.device, cpu), self.device)
        if precision.own_warning and not self.is_rank0:  # (rank 0 says its own; this one read its device unlike it)
            print(precision.warning, file=sys.stderr, flush=True)
        peak, source = device_peak_flops(self.device, precision.dtype, cpu)
        return precision, peak, source

    def _exchange_groups(self):
        """(the ep mesh, the expert_dp mesh) where an MoE's split experts are exchanged in several groups of
        data-parallel ranks, whose routing ExpertLoadMetrics reads group by group; else None (one group: the
        global counts are its own)."""
        if self.mesh is None or not self.config.model.is_moe or self.dims.ep * self.dims.tp == 1:
            return None
        if self.mesh.size("expert_dp") == 1:
            return None
        return self.mesh["ep"], self.mesh["expert_dp"]

    def _say(self, line: str, warning: bool = False) -> None:
        """One line from rank 0: information on stdout, a warning on stderr (beside events and errors)."""
        if self.is_rank0:
            print(line, file=sys.stderr if warning else sys.stdout, flush=True)

    def _restore(self) -> None:
        if self.resume_step is None:
            return
        meta = self.checkpoints.read_meta(self.resume_step)
        # An imported checkpoint holds weights only; everything else starts fresh.
        state = {key: value for key, value in self.state.items() if key in meta.get("contents", self.state)}
        # The checkpoint brings the moments and step counts; the optimizer's settings (weight decay, betas, eps)
        # stay this run's config's, which loading replaces with the saved groups': a resume with a changed weight
        # decay, said by _keep_earlier_settings, went on with the old one. (The learning rate is set every step.)
        settings = [{key: value for key, value in group.items() if key != "params"}
                    for group in self.optimizer.param_groups]
        self.checkpoints.load(self.resume_step, state)
        for group, kept in zip(self.optimizer.param_groups, settings):
            group.update(kept)

    def _keep_earlier_settings(self) -> None:
        """Before config.yaml is rewritten and metrics.jsonl rewound: keep the earlier config.yaml where a resume
        changed settings, and where a folder without a checkpoint held another run's (or no config.yaml) keep both
        its config.yaml and its metrics.jsonl, and say so."""
        saved = self.run_dir / "config.yaml"
        if self.resume_step is None:  # no checkpoint: a run that stopped before its first, or a folder of the user's
            foreign = not saved.is_file() or saved.read_bytes() != config_yaml(self.requested_config).encode()
            if saved.is_file() and foreign:  # (e.g. the very file being trained)
                kept = keep_earlier_config(self.run_dir, 0)
                self._say(f"run.dir held a config.yaml unlike this run's (and no checkpoint): it is kept as "
                          f"{kept.name}", warning=True)
            metrics = self.run_dir / "metrics.jsonl"
            if foreign and metrics.is_file() and metrics.stat().st_size:
                kept = keep_earlier_metrics(self.run_dir)
                self._say(f"run.dir held a metrics.jsonl of another run (and no checkpoint): it is kept as "
                          f"{kept.name}", warning=True)
            return
        if not saved.is_file():
            return
        changed = changed_settings(saved, self.requested_config)
        if changed:
            kept = keep_earlier_config(self.run_dir, self.resume_step)
            self._say(f"resuming from step {self.resume_step} with settings changed since: {'; '.join(changed)} "
                      f"(the earlier config.yaml is kept as {kept.name})", warning=True)

    def heldout(self):
        """This rank's share of the fixed held-out set every evaluation of this run uses."""
        return self.evaluation.heldout()

    def evaluate(self) -> float | None:
        """Held-out loss of the current weights (None when no source has a held-out split)."""
        return self.evaluation.heldout_loss()

    def fit(self) -> TrainSummary:
        """Train from the latest checkpoint (or from scratch) to train.max_steps."""
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._restore()
        if self.is_rank0:
            self._keep_earlier_settings()
            save_config(self.requested_config, self.run_dir / "config.yaml")
            self._say(self.precision.describe())
            if cfg.parallel.grad_reduce_dtype == "bf16" and self.dims.dp > 1:
                self._say(f"gradients reduced in bf16 over the {self.dims.dp} data-parallel ranks "
                          "(parallel.grad_reduce_dtype=bf16): half the bytes, each sum rounded to bf16")
            if self.precision.warning:
                self._say(self.precision.warning, warning=True)
            self._say(f"peak for MFU: {self.peak_flops / 1e12:.4g} TFLOP/s per device ({self.peak_source})")
        start = step = self.progress.step
        self.stop_reason = None
        try:
            self.dispatch("on_train_start", start, cfg.train.max_steps)
            for step in range(start + 1, cfg.train.max_steps + 1):
                self._one_step(step)
                self.dispatch("on_progress", step)
                for callback in self.callbacks:  # guards, a preemption stop, evaluation, checkpoint
                    callback.after_step(step)
                    if self.stop_reason is not None:
                        break
                    self.dispatch("on_progress", step)
                if self.stop_reason is not None:
                    break
            heldout_loss = self.evaluation.last_loss
            if start == cfg.train.max_steps:
                heldout_loss = self.evaluate()
        except BaseException as error:
            self.dispatch("on_error", error)
            raise
        finally:
            self.dispatch("on_train_end", step)
        return TrainSummary(self.run_dir, step, heldout_loss, self.resume_step, self.stop_reason)

    def _one_step(self, step: int) -> None:
        cfg = self.config
        lr = lr_at(step - 1, cfg.train.max_steps, cfg.optim)
        set_lr(self.optimizer, lr)
        self.dispatch("on_step_start", step)
        result = train_step(
            self.model,
            self.optimizer,
            self.data.loader.next_batch(),
            device=self.device,
            dtype=cfg.train.dtype,
            grad_clip=self.grad_clip_at(step),
            dp_mesh=self.mesh["dp"] if self.mesh is not None else None,
            skip_step=self.spike_guard,
            defer_grad_sync=cfg.parallel.defer_grad_sync,
        )
        # the step has spent the gradients: free them now, not at the next step's start, so that evaluation and
        # checkpointing between steps do not hold them (zero1's whole gradients, FSDP's reduced shards)
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step = step
        self.progress.tokens_seen += result.tokens * self.dims.dp  # result.tokens: this data-parallel rank's share
        # every callback hears of the result; a skipped step or a straggler report is logged whatever the cadence
        wanted = [callback.on_step_result(step, result) for callback in self.callbacks]
        if any(wanted) or step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
            self._log_step(step, lr, result)

    def grad_clip_at(self, step: int) -> float:
        """The clipping threshold of `step` (0 = none): off during warm-up with optim.clip_after_warmup."""
        optim = self.config.optim
        return 0.0 if optim.clip_after_warmup and step <= optim.warmup_steps else optim.grad_clip

    def _log_step(self, step: int, lr: float, result: StepResult) -> None:
        """The step's record: its own losses here, the callbacks' fields (throughput, memory, ...) added by them."""
        record = {
            "step": step,
            "loss": result.loss,
            "ce_loss": result.ce_loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens_seen": self.progress.tokens_seen,
            "skipped": result.skipped,
        }
        if result.skipped:
            record["skip_reason"] = result.skip_reason
        if result.aux_loss is not None:
            record.update(aux_loss=result.aux_loss, z_loss=result.z_loss)
        for callback in self.callbacks:
            callback.on_log(step, result, record)
        self.dispatch("on_step_end", step, record)
