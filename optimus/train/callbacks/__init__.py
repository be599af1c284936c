"""Side concerns of the training loop, each a small Callback."""

from optimus.train.callbacks.base import Callback
from optimus.train.callbacks.console import ConsoleProgress
from optimus.train.callbacks.events import EventLines
from optimus.train.callbacks.jsonl import JsonlMetrics, read_metrics
from optimus.train.callbacks.plot import LossPlot

__all__ = ["Callback", "ConsoleProgress", "EventLines", "JsonlMetrics", "LossPlot", "read_metrics"]
