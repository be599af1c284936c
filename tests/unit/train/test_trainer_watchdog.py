"""With resilience.hang_timeout_s the Trainer runs the hang watchdog during fit() only, also when fit() fails."""

from __future__ import annotations

import threading

import pytest

from optimus.config import build_config
from tests.helpers.runs import tiny_run_config
from optimus.train.callbacks import Callback
from optimus.train.trainer import Trainer

# far above a tiny step: firing would end the test process
GENEROUS_TIMEOUT_S = 120.0


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
def test_the_watchdog_runs_during_fit_and_stops_with_it(tmp_path, small_token_dir, fail_at_step):
    config = build_config(tiny_run_config(tmp_path, small_token_dir, train=dict(max_steps=3),
                                          resilience=dict(hang_timeout_s=GENEROUS_TIMEOUT_S)))
    record = WatchdogsPerStep(fail_at_step)
    if fail_at_step is None:
        Trainer(config, callbacks=[record]).fit()
    else:
        with pytest.raises(RuntimeError, match="training failed"):
            Trainer(config, callbacks=[record]).fit()
    assert record.counts == [1] * (fail_at_step or 3)
    assert watchdog_threads() == []
