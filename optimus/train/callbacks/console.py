"""Live progress bar: step, loss, tokens/s, MFU, ETA."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from optimus.train.callbacks.base import Callback


class ConsoleProgress(Callback):
    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.progress: Progress | None = None
        self.task = None

    def on_train_start(self, start_step: int, max_steps: int) -> None:
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=max_steps, completed=start_step, stats="")

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        mfu = "-" if metrics.get("mfu") is None else f"{100 * metrics['mfu']:.1f}%"
        stats = f"loss {metrics['loss']:.4f}  {metrics['tokens_per_s']:,.0f} tok/s  MFU {mfu}"
        self.progress.update(self.task, completed=step, stats=stats)

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None:
        if "eval_loss" in metrics:
            self.progress.console.print(f"step {step}: held-out loss {metrics['eval_loss']:.4f}")
        for task, score in metrics.get("downstream", {}).items():
            self.progress.console.print(f"step {step}: {task} acc {100 * score['acc']:.1f}%  "
                                        f"acc_norm {100 * score['acc_norm']:.1f}%  ({score['n']} questions)")

    def on_train_end(self, step: int) -> None:
        if self.progress is not None:
            self.progress.stop()
