"""The typed config tree: YAML files plus `--section.key=value` overrides, validated by pydantic.

Every section forbids unknown keys, so a typo is an error rather than a silently ignored setting.
`model.preset` fills every model field; fields given beside it win.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from optimus.models.config import ModelConfig
from optimus.models.presets import PRESETS
from optimus.resilience.config import ResilienceConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line naming the problem and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainConfig(_Section):
    seq_len: int = Field(256, gt=0)
    micro_batch_size: int | None = Field(
        None, gt=0, description="samples per forward on a rank (a memory knob); unset: derived from the global "
                                "batch and the data-parallel ranks (see optimus/parallel/validate.py)")
    global_batch_size: int = Field(8, gt=0, description="samples per optimizer step over all ranks (the contract)")
    max_steps: int = Field(100, gt=0)
    seed: int = 0
    log_every: int = Field(1, gt=0)
    eval_every: int = Field(0, ge=0, description="0 = only at the end")
    eval_batches: int = Field(8, gt=0)
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
    activation_checkpointing: Literal["none", "full", "selective", "ops"] = Field(
        "none", description="full: whole blocks; selective: the sub-modules in recompute; ops: op-level policy")
    recompute: list[Literal["attention", "moe", "mlp", "norms"]] = Field(
        default_factory=lambda: ["moe"], description="selective: sub-modules of each block recomputed in backward")
    tensorboard: bool = False

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


class OptimConfig(_Section):
    lr: float = Field(4e-4, gt=0)
    min_lr: float = Field(4e-5, ge=0)
    warmup_steps: int = Field(10, ge=0)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = Field(0.2, gt=0, le=1, description="WSD: fraction of steps spent decaying")
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="0 = no clipping")
    clip_after_warmup: bool = Field(
        False, description="clip only once warm-up is over (the published Mula runs); the norm is logged throughout")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas


class DataSource(_Section):
    """One corpus of the mixture: a packaged corpus by `name`, tokenized memmaps at `path`, or a `glob`
    of OLMo/Dolma token files (flat .npy arrays; `dtype` and `eos_id` default from the tokenizer)."""

    name: str | None = None
    path: str | None = None
    glob: str | None = None
    weight: float = Field(1.0, gt=0)
    dtype: Literal["uint16", "uint32"] | None = None
    eos_id: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _exactly_one_location(self) -> "DataSource":
        if sum(x is not None for x in (self.name, self.path, self.glob)) != 1:
            raise ValueError(
                "give exactly one of 'name' (a packaged corpus), 'path' (tokenized data) or 'glob' (OLMo .npy files)"
            )
        return self


class DataConfig(_Section):
    sources: list[DataSource] = Field(
        default_factory=lambda: [
            DataSource(name="sotu", weight=1.0),
            DataSource(name="wiki-offline", weight=1.0),
            DataSource(name="stdlib", weight=0.5),
        ]
    )
    # A mixture recipe (e.g. configs/data/olmoe-mix-0924.yaml) replaces `sources`: its sources are found
    # under `root` or at `paths[source]`; `weights[source]` overrides its token-count weight.
    recipe: str | None = None
    root: str | None = None
    paths: dict[str, str] = Field(default_factory=dict)
    weights: dict[str, float] = Field(default_factory=dict)
    tokenizer: str = "olmoe"
    heldout_fraction: float = Field(0.02, gt=0, lt=1)
    cache_dir: str = "data"

    @field_validator("sources")
    @classmethod
    def _not_empty(cls, sources: list[DataSource]) -> list[DataSource]:
        if not sources:
            raise ValueError("at least one source is needed")
        return sources

    @model_validator(mode="after")
    def _recipe_or_sources(self) -> "DataConfig":
        if self.recipe is not None and "sources" in self.model_fields_set:
            raise ValueError("give either 'recipe' or 'sources', not both")
        return self


class RunConfig(_Section):
    name: str = "default"
    dir: str | None = None

    @property
    def path(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name


class ParallelConfig(_Section):
    dp_replicate: int = Field(1, gt=0)
    dp_shard: int = Field(1, gt=0)
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    ep: int = Field(1, gt=0)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pp_virtual_stages: int = Field(1, gt=0)
    ep_dispatch: Literal["all_to_all", "allgather"] = "all_to_all"
    defer_grad_sync: Literal["none", "replicate", "all"] = Field(
        "replicate", description="gradient accumulation: reduce only after a step's last micro-batch over dp_replicate "
                                 "(HSDP's all-reduce), over every dp dim (all: unsharded gradients held meanwhile), or none")
    shard_mode: Literal["fsdp", "zero1", "zero2", "ddp"] = Field(
        "fsdp", description="fsdp: FSDP2 (ZeRO-3); zero1/zero2: whole parameters, sharded fp32 master + AdamW "
                            "state (optimus/optim/sharded.py), gradients reduce-scattered at the step / per bucket; "
                            "ddp: nothing sharded, torch DDP (pure data parallel, small models)")
    ep_aware: bool = Field(True, description="zero1/zero2: non-expert state sharded over DP x EP (False: over DP "
                                             "only, replicated across EP: the ablation baseline)")


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    resilience: ResilienceConfig = Field(default_factory=ResilienceConfig)

    @model_validator(mode="after")
    def _layout_fits(self) -> "Config":
        # every layout and batch rule, for the world size the degrees imply (the trainer and the dry run
        # check again for the real world size); imported here: validate.py needs this module's classes
        from optimus.parallel.validate import validate_layout

        validate_layout(self)
        return self

    @model_validator(mode="after")
    def _recompute_mask_matches_model(self) -> "Config":
        # the default mask recomputes the feed-forward the model has; an explicit mask that names
        # only the other kind ("moe" on a dense model) would silently recompute nothing
        train, present, absent = self.train, "moe", "mlp"
        if not self.model.is_moe:
            present, absent = absent, present
        if "recompute" not in train.model_fields_set:
            train.recompute = [present]
        elif train.activation_checkpointing == "selective" and set(train.recompute) <= {absent}:
            kind = "an MoE" if self.model.is_moe else "a dense"
            raise ValueError(
                f"train.recompute {train.recompute} names nothing in {kind} model: use {present}, attention or norms"
            )
        return self


def _parse_scalar(text: str) -> Any:
    """Read an override value the way YAML would (numbers, booleans, lists, null)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ['--train.max_steps=10', '--optim.lr', '1e-3'] into a nested dict."""
    nested: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unrecognised argument '{arg}': overrides look like --section.key=value")
        key, sep, value = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError(f"override '{arg}' has no value: write --{key}=VALUE")
            i += 1
            value = args[i]
        node = nested
        *parents, leaf = key.replace("-", "_").split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{arg}' clashes with another override of '{part}'")
        node[leaf] = _parse_scalar(value)
        i += 1
    return nested


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _apply_preset(raw: dict[str, Any]) -> dict[str, Any]:
    model = raw.get("model") or {}
    if not isinstance(model, dict):
        raise ConfigError("config key 'model' must be a mapping of model fields")
    preset = model.get("preset")
    if preset is None:
        return raw
    if preset not in PRESETS:
        raise ConfigError(f"unknown model.preset '{preset}': choose one of {', '.join(sorted(PRESETS))}")
    filled = PRESETS[preset].model_dump()
    filled.update(model)
    return {**raw, "model": filled}


def _format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        section = ".".join(str(p) for p in first["loc"][:-1]) or "top level"
        return f"unknown config key '{where}': check the spelling (allowed keys are those of the {section} section)"
    if first["type"] == "missing":
        return f"missing config key '{where}': add it to the config file or pass --{where}=VALUE"
    given = first.get("input")
    if isinstance(given, dict):  # a check across keys (a section's or the whole config's validator)
        return first["msg"].removeprefix("Value error, ")
    return f"bad value for '{where}' ({given!r}): {first['msg']}"


def build_config(raw: dict[str, Any]) -> Config:
    """Validate a nested dict into a Config, raising ConfigError with a one-line message."""
    raw = _apply_preset(raw)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config file (or the defaults when path is None) and apply CLI overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' not found: pass the path of a YAML file (see configs/)")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file '{path}' is not valid YAML{where}: fix the syntax") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections (model, train, ...)")
    raw = _deep_merge(raw, parse_overrides(overrides or []))
    return build_config(raw)


def save_config(config: Config, path: str | Path) -> None:
    """Write the fully resolved config as YAML (what `config.yaml` in a run directory holds)."""
    data = config.model_dump(mode="json")
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
