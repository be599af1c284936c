"""The typed config tree: YAML files plus `--section.key=value` overrides, validated by pydantic.

Every section forbids unknown keys, so a typo is an error rather than a silently ignored setting.
`model.preset` fills every model field; fields given beside it win. Each section's class lives
beside the code it configures (models/, train/, optim/, data/, parallel/, resilience/config.py);
this module only assembles them into `Config`, loads YAML and overrides, and raises ConfigError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from optimus.data.config import DataConfig, DataSource
from optimus.models.config import ModelConfig
from optimus.models.presets import PRESETS
from optimus.optim.config import OptimConfig
from optimus.parallel.config import ParallelConfig, ParallelDegrees
from optimus.resilience.config import ResilienceConfig
from optimus.train.config import TrainConfig

# the sections live beside what they configure; re-exported so `from optimus.config import TrainConfig` works
__all__ = [
    "Config", "ConfigError", "DataConfig", "DataSource", "ModelConfig", "OptimConfig", "ParallelConfig",
    "ParallelDegrees", "ResilienceConfig", "RunConfig", "TrainConfig", "build_config", "load_config",
    "parse_overrides", "save_config",
]


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line naming the problem and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunConfig(_Section):
    """Where the run directory is: runs/NAME unless `dir` is given."""

    name: str = "default"
    dir: str | None = None

    @property
    def path(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name


class Config(_Section):
    """The whole config tree: one section per concern, each defined beside the code it configures."""

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
    if not isinstance(preset, str) or preset not in PRESETS:  # a mapping or list (--model.preset.x=1) is no name
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
    return f"bad value for '{where}' ({given!r}): {first['msg'].removeprefix('Value error, ')}"


def build_config(raw: dict[str, Any]) -> Config:
    """Validate a nested dict into a Config, raising ConfigError with a one-line message."""
    raw = _apply_preset(raw)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


class YamlFileError(ValueError):
    """What is wrong with a YAML file: a phrase to follow its name ("is not valid YAML at line 3"), and the fix."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}: {fix}")
        self.problem, self.fix = problem, fix


class _KeyGivenTwice(yaml.YAMLError):
    def __init__(self, key: Any, line: int):
        super().__init__(f"key {key!r} given twice")
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping: PyYAML keeps the last one without a word, so an
    edit that adds a setting already set further up would silently win or lose."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be set again here, as YAML means
            continue
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, (str, int, float, bool)):  # (an unhashable key: construct_mapping says so)
            continue
        if key in seen:
            raise _KeyGivenTwice(key, key_node.start_mark.line + 1)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content, or YamlFileError where its text is not YAML or not UTF-8, or gives a key twice in one
    mapping (the caller names the file: a config, a cluster preset, a data recipe, a run's config.yaml)."""
    try:
        return yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)  # safe: a SafeLoader
    except _KeyGivenTwice as err:
        raise YamlFileError(f"gives the key {err.key!r} twice (the second at line {err.line})",
                            "keep one of them") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise YamlFileError(f"is not valid YAML{where}", "fix the syntax") from None
    except UnicodeDecodeError as err:
        raise YamlFileError(f"is not UTF-8 text (byte {err.start})", "pass a YAML file, or save it as UTF-8") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config file (or the defaults when path is None) and apply CLI overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "not found"
            raise ConfigError(f"config file '{path}' {what}: pass the path of a YAML file (see configs/)")
        try:
            raw = read_yaml(path) or {}
        except YamlFileError as err:
            raise ConfigError(f"config file '{path}' {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections (model, train, ...)")
    raw = _deep_merge(raw, parse_overrides(overrides or []))
    return build_config(raw)


def config_yaml(config: Config) -> str:
    """The fully resolved config as YAML text (what `config.yaml` in a run directory holds)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def save_config(config: Config, path: str | Path) -> None:
    """Write the fully resolved config as YAML (what `config.yaml` in a run directory holds)."""
    Path(path).write_text(config_yaml(config))
