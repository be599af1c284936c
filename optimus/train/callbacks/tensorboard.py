"""Optional TensorBoard scalars under RUN/tensorboard (train.tensorboard=true; `pip install optimus[loggers]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optimus.config import ConfigError
from optimus.train.callbacks.base import Callback
from optimus.train.callbacks.scalars import checkpoint_scalars, eval_scalars, step_scalars


class TensorBoardLogger(Callback):
    """The metrics of metrics.jsonl as TensorBoard scalars (names: callbacks/scalars.py)."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("train.tensorboard=true needs the tensorboard package: pip install tensorboard "
                              "(or pip install 'optimus[loggers]'), or set train.tensorboard=false") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self._write(step, step_scalars(metrics))

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None:
        self._write(step, eval_scalars(metrics))

    def on_checkpoint_timing(self, step: int, record: dict[str, Any]) -> None:
        self._write(step, checkpoint_scalars(record))

    def on_train_end(self, step: int) -> None:
        self.writer.close()
