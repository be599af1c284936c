"""One stderr line for each event a long run's operator must see, with or without the progress bar:
a skipped optimizer step (and why) and a straggler report (which ranks are slow)."""

from __future__ import annotations

import sys
from typing import Any

from optimus.train.callbacks.base import Callback


class EventLines(Callback):
    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        # plain print: under the live progress bar rich redirects stderr and shows it above the bar
        if metrics.get("skipped"):
            print(f"step {step}: optimizer step skipped ({metrics.get('skip_reason')}, loss {metrics['loss']:.4g})",
                  file=sys.stderr, flush=True)
        if metrics.get("stragglers"):
            named = ", ".join(f"rank {s['rank']} ({s['host']}) {s['step_time_s']:.3f} s" for s in metrics["stragglers"])
            median = metrics["stragglers"][0]["median_s"]
            print(f"step {step}: straggling ranks (median step {median:.3f} s): {named}", file=sys.stderr, flush=True)
