"""Side concerns of the training loop, each a small Callback (the hooks: base.py).

Exported here: the reporting callbacks, which run on rank 0. The loop's own side concerns
(checkpointing, evaluation, step metrics, resilience) live in their modules and are created by the
Trainer on every rank.
"""

from optimus.train.callbacks.base import Callback
from optimus.train.callbacks.console import ConsoleProgress
from optimus.train.callbacks.events import EventLines
from optimus.train.callbacks.jsonl import JsonlMetrics, read_metrics
from optimus.train.callbacks.plot import LossPlot
from optimus.train.callbacks.report import RunReport

__all__ = ["Callback", "ConsoleProgress", "EventLines", "JsonlMetrics", "LossPlot", "RunReport", "read_metrics"]
