"""The Trainer puts a straggler report into that step's metrics record, off the logging cadence too.

(Which ranks are slow is tested across real ranks in tests/distributed/test_resilience.py; here one
process stands in a monitor that reports a fixed straggler at step 3.)
"""

from __future__ import annotations

import contextlib


from optimus.config import build_config
from optimus.resilience.stragglers import Straggler
from tests.helpers.runs import tiny_run_config
from optimus.train.callbacks import JsonlMetrics, read_metrics
from optimus.train.trainer import Trainer


class SlowRankAtStep3:
    def __init__(self):
        self.timed = 0

    @contextlib.contextmanager
    def timed_step(self):
        self.timed += 1
        yield

    def check(self, step):
        return [Straggler(rank=1, host="node-b", step_time_s=0.9, median_s=0.3)] if step == 3 else None


def test_a_straggler_report_is_logged_in_that_steps_record(tmp_path, small_token_dir):
    config = build_config(tiny_run_config(tmp_path, small_token_dir,
                                          train=dict(max_steps=4, log_every=4, eval_every=0)))
    metrics = tmp_path / "metrics.jsonl"
    trainer = Trainer(config, callbacks=[JsonlMetrics(metrics)])
    assert trainer.stragglers is None  # one process: nothing to compare
    trainer.stragglers = monitor = SlowRankAtStep3()
    trainer.fit()
    records = {r["step"]: r for r in read_metrics(metrics) if "loss" in r}
    assert sorted(records) == [3, 4]
    assert records[3]["stragglers"] == [{"rank": 1, "host": "node-b", "step_time_s": 0.9, "median_s": 0.3}]
    assert "stragglers" not in records[4]
    assert monitor.timed == 4
