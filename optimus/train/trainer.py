"""The training loop: build everything from a config, resume if a checkpoint exists, step, evaluate,
checkpoint. What a step computes lives in step.py; side concerns are callbacks.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from optimus.checkpoint.manager import CheckpointError, CheckpointManager
from optimus.checkpoint.preflight import CHECKPOINT_BYTES_PER_PARAMETER
from optimus.config import Config, save_config
from optimus.data.build import build_training_data
from optimus.data.loader import heldout_batches
from optimus.eval.loop import downstream_accuracies
from optimus.models.flops import count_parameters, flops_per_token
from optimus.models.transformer import Transformer, build_model
from optimus.optim.build import build_optimizer, set_lr
from optimus.optim.schedule import lr_at
from optimus.parallel.launch import cpu_speed_cache, detect_launch_env, device_for, init_distributed
from optimus.parallel.pipeline import get_pipeline
from optimus.parallel.parallelize import build_parallel_model
from optimus.parallel.validate import validate_layout
from optimus.resilience.guards import ConsecutiveSkips, LossSpikeGuard
from optimus.resilience.signals import PreemptionSignals, signal_name
from optimus.resilience.stragglers import Straggler, StragglerMonitor
from optimus.resilience.watchdog import HangWatchdog
from optimus.train.callbacks import Callback, ConsoleProgress, EventLines, JsonlMetrics, LossPlot
from optimus.train.evaluate import evaluate
from optimus.train.hardware import cpu_speed, device_peak_flops
from optimus.train.metrics import Throughput, expert_load_summary
from optimus.train.precision import Precision, choose_precision
from optimus.train.state import LoaderState, ModelState, OptimizerState, ProgressState, RNGState
from optimus.train.step import StepResult, autocast_context, train_step

# Model fields that do not change the weights' meaning: a checkpoint may be resumed across them.
_MODEL_FIELDS_FREE_TO_CHANGE = {"preset", "moe_impl", "aux_loss_coef", "z_loss_coef", "init_std"}


@dataclass
class TrainSummary:
    run_dir: Path
    step: int
    heldout_loss: float | None
    resumed_from: int | None
    stopped_by_signal: str | None = None  # e.g. "SIGTERM": checkpointed at `step` and stopped early


def model_fingerprint(config: Config) -> dict:
    """The model settings a checkpoint must agree with to be loaded."""
    return {k: v for k, v in config.model.model_dump().items() if k not in _MODEL_FIELDS_FREE_TO_CHANGE}


def check_checkpoint_matches(meta: dict, config: Config, where: Path) -> None:
    """Refuse a checkpoint written for another model, naming the first field that differs."""
    saved = meta.get("model", {})
    for key, value in model_fingerprint(config).items():
        if key in saved and saved[key] != value:
            raise CheckpointError(
                f"checkpoint in {where} was written for a different model (model.{key} = {saved[key]!r}, "
                f"config says {value!r}): use the same model settings or another run.dir"
            )


class Trainer:
    """Owns the model, optimizer, data and checkpoints of one run; `fit()` trains to max_steps."""

    def __init__(self, config: Config, callbacks: list[Callback] | None = None, progress_bar: bool = True):
        self.config = config
        self.run_dir = config.run.path
        launch = detect_launch_env()
        self.device = device_for(launch.local_rank)
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
        self.mesh = self.dims.build_mesh(self.device.type) if self.dims.is_parallel else None
        dp_rank = self.mesh.local_rank("dp") if self.mesh else 0
        torch.manual_seed(config.train.seed)
        self.data = build_training_data(config, dp_rank=dp_rank, dp_size=self.dims.dp)
        self.checkpoints = CheckpointManager(self.run_dir, config.train.keep_last_k, device=self.device)
        # the whole model's count (on meta, free): under PP this rank's model holds only its stages
        params = count_parameters(build_model(config.model, device="meta"), config.model)
        self.checkpoints.preflight(checkpoint_bytes=params.total * CHECKPOINT_BYTES_PER_PARAMETER)
        self.resume_step, skipped = self.checkpoints.newest_usable()  # damaged ones are moved aside, never deleted
        if skipped and self.is_rank0:
            print(f"resuming from step {self.resume_step}: skipped checkpoint {'; '.join(skipped)}",
                  file=sys.stderr, flush=True)
        if self.resume_step is not None:
            check_checkpoint_matches(self.checkpoints.read_meta(self.resume_step), config, self.run_dir)

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
        self.stragglers = (StragglerMonitor(r.straggler_every, r.straggler_factor, self.device)
                           if r.straggler_every and launch.world_size > 1 else None)
        self.flops_per_token = flops_per_token(params, config.model, config.train.seq_len)
        self.peak_flops = peak
        self.throughput = Throughput(self.flops_per_token, peak, replicas=self.dims.dp, world_size=launch.world_size)
        self._warned_impossible_mfu = False
        self._logged_first_row = False
        if not self.is_rank0:
            callbacks = []
        self.callbacks = callbacks if callbacks is not None else self._default_callbacks(progress_bar)
        self._heldout = None
        self._signals: PreemptionSignals | None = None  # set while fit() runs
        self._watchdog: HangWatchdog | None = None

    def _default_callbacks(self, progress_bar: bool) -> list[Callback]:
        callbacks: list[Callback] = [JsonlMetrics(self.run_dir / "metrics.jsonl"), LossPlot(self.run_dir), EventLines()]
        if progress_bar:
            callbacks.insert(0, ConsoleProgress())
        if self.config.train.tensorboard:
            from optimus.train.callbacks.tensorboard import TensorBoardLogger

            callbacks.append(TensorBoardLogger(self.run_dir / "tensorboard"))
        return callbacks

    def _choose_precision(self, requested: str) -> tuple[Precision, float, str]:
        """(training precision, peak FLOP/s of this device in it, the peak's source)."""
        cpu = None
        if self.device.type == "cpu":
            cache_file, kernel_env = cpu_speed_cache()
            cpu = cpu_speed(cache_file, kernel_env)
        precision = choose_precision(requested, self.device, cpu)
        peak, source = device_peak_flops(self.device, precision.dtype, cpu)
        return precision, peak, source

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
        self.checkpoints.load(self.resume_step, state)

    def _save(self, step: int) -> None:
        self._commit_pending_checkpoint()
        meta = {"model": self.config.model.model_dump(), "contents": sorted(self.state)}
        asynchronous = self.config.train.async_checkpoint
        self.checkpoints.save(step, self.state, meta, asynchronous=asynchronous)
        if not asynchronous:
            self._announce_checkpoint(step)

    def _commit_pending_checkpoint(self) -> None:
        step = self.checkpoints.finish_pending()
        if step is not None:
            self._announce_checkpoint(step)

    def _commit_pending_checkpoint_on_error(self) -> None:
        # training already failed: keep a checkpoint that finished writing, but report the first error
        try:
            step = self.checkpoints.finish_pending_on_exit()
            if step is not None:
                self._announce_checkpoint(step)
        except Exception as err:
            warnings.warn(f"after training failed, keeping the checkpoint it was writing failed too: {err}",
                          stacklevel=2)

    def _announce_checkpoint(self, step: int) -> None:
        """Callbacks hear of a checkpoint once it is committed, i.e. once a rerun would resume from it."""
        for callback in self.callbacks:
            callback.on_checkpoint(step)

    def heldout(self):
        """The fixed held-out batches used for every evaluation of this run."""
        if self._heldout is None:
            t = self.config.train
            self._heldout = heldout_batches(self.data.heldout, t.seq_len, t.micro_batch_size, t.eval_batches)
        return self._heldout

    def evaluate(self) -> float | None:
        """Held-out loss of the current weights (None when no source has a held-out split)."""
        batches = self.heldout()
        if not batches:
            return None
        pipeline = get_pipeline(self.model)  # PP: each rank holds only its stages' layers
        if pipeline is not None:
            return pipeline.evaluate_loss(batches, self.device, autocast_context(self.device, self.config.train.dtype))
        return evaluate(self.model, batches, self.device, self.config.train.dtype).loss

    def fit(self) -> TrainSummary:
        """Train from the latest checkpoint (or from scratch) to train.max_steps."""
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._restore()
        if self.is_rank0:
            save_config(self.requested_config, self.run_dir / "config.yaml")
            self._say(self.precision.describe())
            if self.precision.warning:
                self._say(self.precision.warning, warning=True)
            self._say(f"peak for MFU: {self.peak_flops / 1e12:.4g} TFLOP/s per device ({self.peak_source})")
        start = self.progress.step
        for callback in self.callbacks:
            callback.on_train_start(start, cfg.train.max_steps)
        self.throughput.report()  # start the throughput window now, not at construction
        heldout_loss = None
        step = start
        stopped_by_signal = None
        resilience = contextlib.ExitStack()
        try:
            self._start_resilience(resilience)
            for step in range(start + 1, cfg.train.max_steps + 1):
                self._one_step(step)
                self._beat(step)
                at_end = step == cfg.train.max_steps
                stopped_by_signal = None if at_end else self._checkpoint_if_signalled(step)
                if stopped_by_signal:
                    break
                if at_end or (cfg.train.eval_every and step % cfg.train.eval_every == 0):
                    heldout_loss = self._log_eval(step)
                    self._beat(step)
                if at_end or (cfg.train.ckpt_every and step % cfg.train.ckpt_every == 0):
                    self._save(step)
                    self._beat(step)
            self._commit_pending_checkpoint()
            if start == cfg.train.max_steps:
                heldout_loss = self.evaluate()
        except BaseException:
            self._commit_pending_checkpoint_on_error()
            raise
        finally:
            resilience.close()
            for callback in self.callbacks:
                callback.on_train_end(step)
        return TrainSummary(self.run_dir, step, heldout_loss, self.resume_step, stopped_by_signal)

    def _start_resilience(self, resilience: contextlib.ExitStack) -> None:
        """Catch preemption signals and watch for hangs while fit() runs, as configured; `resilience` undoes both."""
        cfg = self.config.resilience
        self._signals = resilience.enter_context(PreemptionSignals()) if cfg.checkpoint_on_signal else None
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._watchdog = (resilience.enter_context(HangWatchdog(cfg.hang_timeout_s, rank))
                          if cfg.hang_timeout_s > 0 else None)

    def _beat(self, step: int) -> None:
        if self._watchdog is not None:
            self._watchdog.beat(step)

    def _checkpoint_if_signalled(self, step: int) -> str | None:
        """At a step boundary: when any rank got a preemption signal, commit a checkpoint of `step` on every
        rank and return the signal's name (then fit stops; this step's scheduled evaluation is skipped)."""
        signum = self._signals.received_on_any_rank(self.device) if self._signals is not None else 0
        if not signum:
            return None
        self._save(step)
        self._commit_pending_checkpoint()  # an asynchronous save must be on disk before the process ends
        self._beat(step)
        name = signal_name(signum)
        if self.is_rank0:
            print(f"{name} at step {step}: checkpoint saved, exiting; rerun the same command to resume",
                  file=sys.stderr, flush=True)
        return name

    def _one_step(self, step: int) -> None:
        cfg = self.config
        lr = lr_at(step - 1, cfg.train.max_steps, cfg.optim)
        set_lr(self.optimizer, lr)
        for callback in self.callbacks:
            callback.on_step_start(step)
        with self.stragglers.timed_step() if self.stragglers is not None else contextlib.nullcontext():
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
        self.progress.step = step
        self.progress.tokens_seen += result.tokens * self.dims.dp  # result.tokens: this data-parallel rank's share
        self.throughput.add(result.tokens)
        stragglers = self.stragglers.check(step) if self.stragglers is not None else None
        # a skipped step or a straggler report is logged whatever the cadence: it is rare and telling
        if result.skipped or stragglers or step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
            self._log_step(step, lr, result, stragglers)
        detail = self._describe_skip(result) if result.skipped else ""
        self.consecutive_skips.update(step, result.skip_reason, detail)  # raises after too many in a row

    def grad_clip_at(self, step: int) -> float:
        """The clipping threshold of `step` (0 = none): off during warm-up with optim.clip_after_warmup."""
        optim = self.config.optim
        return 0.0 if optim.clip_after_warmup and step <= optim.warmup_steps else optim.grad_clip

    def _describe_skip(self, result: StepResult) -> str:
        if result.skip_reason == "loss spike" and self.spike_guard is not None:
            return self.spike_guard.describe(result.loss)
        return f"loss {result.loss:.4g}, gradient norm {result.grad_norm:.4g}"

    def _log_step(self, step: int, lr: float, result: StepResult, stragglers: list[Straggler] | None) -> None:
        throughput = self.throughput.report()
        if throughput.impossible_mfu is not None and not self._warned_impossible_mfu:
            self._warned_impossible_mfu = True
            self._say(f"warning: MFU computed as {100 * throughput.impossible_mfu:.0f}%, above 100%: the peak of "
                      f"{self.peak_flops / 1e12:.4g} TFLOP/s ({self.peak_source}) is too low, so MFU is not reported", warning=True)
        metrics = {
            "step": step,
            "loss": result.loss,
            "ce_loss": result.ce_loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens_seen": self.progress.tokens_seen,
            "tokens_per_s": throughput.tokens_per_s,
            "tokens_per_s_per_device": throughput.tokens_per_s_per_device,
            "mfu": throughput.mfu,
            "skipped": result.skipped,
        }
        if not self._logged_first_row:
            # how the figures above were obtained, once per run segment: the first row of metrics.jsonl
            self._logged_first_row = True
            metrics.update(dtype=self.precision.dtype, dtype_requested=self.precision.requested,
                           dtype_reason=self.precision.reason, peak_flops_per_device=self.peak_flops,
                           peak_source=self.peak_source, world_size=self.dims.world_size)
        if result.skipped:
            metrics["skip_reason"] = result.skip_reason
        if result.aux_loss is not None:
            metrics.update(aux_loss=result.aux_loss, z_loss=result.z_loss)
            metrics.update(expert_load_summary(result.expert_counts))
        if stragglers:
            metrics["stragglers"] = [s.as_record() for s in stragglers]
        for callback in self.callbacks:
            callback.on_step_end(step, metrics)

    def _log_eval(self, step: int) -> float | None:
        loss = self.evaluate()
        record = {"step": step} if loss is None else {"step": step, "eval_loss": loss}
        downstream = downstream_accuracies(self.model, self.config, self.device, self.mesh)
        if downstream:
            record["downstream"] = downstream
        if len(record) > 1:
            for callback in self.callbacks:
                callback.on_eval(step, record)
        return loss
