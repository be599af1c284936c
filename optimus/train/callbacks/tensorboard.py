"""Optional TensorBoard scalars (needs `pip install tensorboard`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optimus.train.callbacks.base import Callback


class TensorBoardLogger(Callback):
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("train.tensorboard=true needs the tensorboard package: pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(f"train/{key}", value, step)

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None:
        if "eval_loss" in metrics:
            self.writer.add_scalar("eval/loss", metrics["eval_loss"], step)
        for task, score in metrics.get("downstream", {}).items():
            self.writer.add_scalar(f"downstream/{task}/acc", score["acc"], step)
            self.writer.add_scalar(f"downstream/{task}/acc_norm", score["acc_norm"], step)

    def on_train_end(self, step: int) -> None:
        self.writer.close()
