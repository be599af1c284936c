"""loss.png: training and held-out loss against step, redrawn at each checkpoint and at the end."""

from __future__ import annotations

from pathlib import Path

from optimus.train.callbacks.base import Callback
from optimus.train.callbacks.jsonl import iter_metrics


def plot_losses(metrics_path: Path, out_path: Path) -> None:
    """Draw loss curves from a metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, heldout = [], []
    for record in iter_metrics(metrics_path):  # line by line: only the two losses of each record are kept
        if "loss" in record:
            train.append((record["step"], record["loss"]))
        if "eval_loss" in record:
            heldout.append((record["step"], record["eval_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if heldout:
        ax.plot(*zip(*heldout), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if train or heldout:  # (a legend of nothing warns on stderr, above whatever error ended the run)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


class LossPlot(Callback):
    def __init__(self, run_dir: Path):
        self.metrics_path = run_dir / "metrics.jsonl"
        self.out_path = run_dir / "loss.png"

    def on_checkpoint(self, step: int) -> None:
        plot_losses(self.metrics_path, self.out_path)

    def on_train_end(self, step: int) -> None:
        plot_losses(self.metrics_path, self.out_path)
