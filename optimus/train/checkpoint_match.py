"""Whether a checkpoint's meta.json was written for the model a config builds (training resumes and the verbs that
load a run both ask; kept apart from the trainer so that `eval`, `generate` and `export` need not import it)."""

from __future__ import annotations

from pathlib import Path

from optimus.checkpoint.manager import CheckpointError
from optimus.config import Config

# Model fields that do not change the weights' meaning: a checkpoint may be resumed across them.
_MODEL_FIELDS_FREE_TO_CHANGE = {"preset", "moe_impl", "aux_loss_coef", "z_loss_coef", "init_std"}


def model_fingerprint(config: Config) -> dict:
    """The model settings a checkpoint must agree with to be loaded."""
    return {k: v for k, v in config.model.model_dump().items() if k not in _MODEL_FIELDS_FREE_TO_CHANGE}


def check_checkpoint_matches(meta: dict, config: Config, where: Path,
                             fix: str = "use the same model settings or another run.dir") -> None:
    """Refuse a checkpoint written for another model, naming the first field that differs."""
    saved = meta.get("model", {})
    for key, value in model_fingerprint(config).items():
        if key in saved and saved[key] != value:
            raise CheckpointError(
                f"checkpoint in {where} was written for a different model (model.{key} = {saved[key]!r}, "
                f"config says {value!r}): {fix}"
            )
