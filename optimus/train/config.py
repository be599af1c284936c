"""Typed settings of the training loop (the `train:` config section); no torch here, so a config loads fast."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class WandbConfig(BaseModel):
    """Weights & Biases logging, offline only: files under RUN/wandb, uploaded later with `wandb sync`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    project: str = "optimus"
    name: str | None = Field(None, description="unset: run.name")


class TrainConfig(BaseModel):
    """The training loop: sequence and batch sizes, steps, logging, evaluation, checkpoints, precision."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    seq_len: int = Field(256, gt=0)
    micro_batch_size: int | None = Field(
        None, gt=0, description="samples per forward on a rank (a memory knob); unset: derived from the global "
                                "batch and the data-parallel ranks (see optimus/parallel/validate.py)")
    global_batch_size: int = Field(8, gt=0, description="samples per optimizer step over all ranks (the contract)")
    max_steps: int = Field(100, gt=0)
    seed: int = Field(0, ge=0, lt=2**63, description="seeds the weights' initialisation and the data order (torch "
                                                  "takes a 64-bit seed)")
    log_every: int = Field(1, gt=0)
    eval_every: int = Field(0, ge=0, description="0 = only at the end")
    eval_batches: int = Field(8, gt=0, description="the held-out set: this many global batches of windows, the "
                              "same for every layout, split over the data-parallel ranks")
    eval_tasks: list[str] = Field(
        default_factory=list, description="downstream tasks scored at every evaluation (see optimus/eval/tasks.py); "
                                          "not under pipeline parallelism")
    eval_tasks_limit: int | None = Field(None, gt=0, description="the first N questions of each task; unset: all")
    ckpt_every: int = Field(50, ge=0, description="0 = only at the end")
    keep_last_k: int = Field(2, gt=0)
    async_checkpoint: bool = Field(
        False, description="write checkpoints in the background while training goes on (DCP async_save); "
                           "each is committed before the next save, a load, or the end of training")
    dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 where the device computes it natively, fp32 elsewhere (see train/precision.py)")
    compile: bool = False
    memory_check: bool = Field(
        True, description="before building the model, refuse a layout whose predicted peak per rank (the planner's "
                          "memory model, optimus/plan/memory.py) exceeds the memory the rank has (see "
                          "train/memory_fit.py); false: try anyway")
    reuse_host_memory: bool = Field(
        True, description="on the CPU, keep freed blocks under 1 GiB for reuse (glibc; see train/host_memory.py): "
                          "steps 1.07-1.35x faster, peak resident set up to ~1.5x; false: glibc's default")
    activation_checkpointing: Literal["none", "full", "selective", "selective_ops"] = Field(
        "none", description="full: whole blocks recomputed; selective: the sub-modules in recompute; selective_ops: "
                            "every block, matmul and attention outputs kept, cheap elementwise ops recomputed")
    recompute: list[Literal["attention", "moe", "mlp", "norms"]] = Field(
        default_factory=lambda: ["moe"], description="selective: sub-modules of each block recomputed in backward")
    report: bool = Field(True, description="write RUN/report.html (plots of the run) at the end of training; "
                                          "`optimus report RUN` writes it at any time")
    loss_plot: bool = Field(True, description="redraw RUN/loss.png at each checkpoint and at the end (~0.2 s a "
                                             "drawing, ~1 s to import matplotlib: tiny test runs switch it off)")
    tensorboard: bool = False
    wandb: WandbConfig | None = Field(None, description="set (e.g. {project: mula}) to log to W&B offline; "
                                                        "needs the wandb package")

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _renamed_checkpointing(cls, mode: object) -> object:
        if mode == "ops":  # the old name, refused rather than silently read: configs say what they mean
            raise ValueError("'ops' is now called 'selective_ops': write train.activation_checkpointing: selective_ops")
        return mode

    @field_validator("eval_tasks")
    @classmethod
    def _known_tasks(cls, names: list[str]) -> list[str]:
        from optimus.eval.tasks import check_task_names  # stdlib-only module: no torch at config time

        return check_task_names(names)

    @field_validator("recompute")
    @classmethod
    def _recompute_named(cls, recompute: list[str], info: ValidationInfo) -> list[str]:
        if not recompute and info.data.get("activation_checkpointing") == "selective":
            raise ValueError("train.activation_checkpointing=selective needs at least one of attention, moe, mlp, "
                             "norms in train.recompute")
        return recompute
