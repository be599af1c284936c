"""Optional Weights & Biases logging (train.wandb; `pip install optimus[loggers]`), always offline.

The run is written under RUN/wandb and never sent anywhere: `wandb sync RUN/wandb/offline-run-*`
uploads it later, from a machine that may. The scalar names are TensorBoard's (callbacks/scalars.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optimus.config import Config, ConfigError
from optimus.train.config import WandbConfig
from optimus.train.callbacks.base import Callback
from optimus.train.callbacks.scalars import checkpoint_scalars, eval_scalars, step_scalars


class WandbLogger(Callback):
    def __init__(self, settings: WandbConfig, config: Config, run_dir: Path):
        try:
            import wandb
        except ImportError:
            raise ConfigError("train.wandb needs the wandb package: pip install wandb (or pip install "
                              "'optimus[loggers]'), or leave train.wandb out") from None
        self.settings, self.config, self.run_dir = settings, config, Path(run_dir)
        self._wandb = wandb
        self.run = None

    def on_train_start(self, start_step: int, max_steps: int) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # mode="offline": nothing leaves this machine; the run's files stay under RUN/wandb. W&B neither
        # captures the console (the trainer's lines stay as they are) nor samples system statistics.
        quiet = self._wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False,
                                     disable_git=True)
        self.run = self._wandb.init(project=self.settings.project, name=self.settings.name or self.config.run.name,
                                    dir=str(self.run_dir), mode="offline", config=self.config.model_dump(mode="json"),
                                    settings=quiet)

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        if self.run is not None and scalars:
            self.run.log({**scalars, "step": step})

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self._log(step, step_scalars(metrics))

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None:
        self._log(step, eval_scalars(metrics))

    def on_checkpoint_timing(self, step: int, record: dict[str, Any]) -> None:
        self._log(step, checkpoint_scalars(record))

    def on_train_end(self, step: int) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
