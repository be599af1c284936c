"""The Trainer with the loss-spike guard: a spike is skipped and logged, too many skips in a row stop the
run with one line (exit code 2 from the CLI), and the guard's statistics resume exactly."""

from __future__ import annotations

import pytest
import torch
import yaml

from optimus.cli import main
from optimus.config import build_config
from optimus.models.transformer import Transformer
from tests.helpers.runs import tiny_run_config
from optimus.train.callbacks import JsonlMetrics, read_metrics
from optimus.train.trainer import Trainer


def raw_config(run_dir, token_dir, max_steps=12, **resilience):
    # one micro-batch per step, no evaluation before the end: the n-th training forward is step n
    return tiny_run_config(run_dir, token_dir,
                           train=dict(max_steps=max_steps, log_every=5, eval_every=0, ckpt_every=0),
                           resilience=dict(spike_zscore=4.0, spike_window=8, **resilience))


@pytest.fixture
def spike_at_steps(monkeypatch):
    """spike_at_steps({10, 11}): the training loss of those steps (counted from this run's first) x 1000."""

    def install(steps: set[int]):
        forward, calls = Transformer.forward, [0]

        def spiky_forward(self, input_ids, labels=None):
            out = forward(self, input_ids, labels)
            if torch.is_grad_enabled():
                calls[0] += 1
                if calls[0] in steps:
                    out.loss = out.loss * 1000
            return out

        monkeypatch.setattr(Transformer, "forward", spiky_forward)

    return install


def test_a_spike_is_skipped_and_logged_off_the_logging_cadence(tmp_path, small_token_dir, spike_at_steps):
    spike_at_steps({10})
    metrics = tmp_path / "metrics.jsonl"
    Trainer(build_config(raw_config(tmp_path, small_token_dir)), callbacks=[JsonlMetrics(metrics)]).fit()
    records = {r["step"]: r for r in read_metrics(metrics) if "loss" in r}
    assert sorted(records) == [5, 10, 12]  # log_every=5, the end, and the skipped step 10
    assert records[10]["skipped"] and records[10]["skip_reason"] == "loss spike"
    assert not records[5]["skipped"] and not records[12]["skipped"] and "skip_reason" not in records[12]


def test_too_many_skips_in_a_row_stop_the_cli_with_one_line(tmp_path, small_token_dir, spike_at_steps, capsys):
    spike_at_steps({10, 11, 12})
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw_config(tmp_path / "run", small_token_dir, max_consecutive_skips=3)))
    assert main(["train", str(config), "--no-progress"]) == 2
    *events, err = capsys.readouterr().err.strip().splitlines()
    # each skipped step was announced as it happened; the run ends with one error line, no traceback
    # (after the start-up lines that say which precision and peak the run uses)
    assert [line.split(":")[0] for line in events if not line.startswith(("precision:", "peak for MFU:"))] == [
        "step 10", "step 11", "step 12"]
    assert err.startswith("optimus train: error: step 12: 3 optimizer steps in a row were skipped (last: loss spike")
    assert "optim.lr" in err and "earlier checkpoint" in err
    steps = [(r["step"], r["skipped"]) for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert steps == [(5, False), (10, True), (11, True), (12, True)]


def test_the_guard_statistics_and_skip_count_resume_exactly(tmp_path, small_token_dir, spike_at_steps):
    spike_at_steps({10})
    first = Trainer(build_config(raw_config(tmp_path, small_token_dir, max_steps=10)), callbacks=[])
    first.fit()  # checkpoints step 10, a skipped step
    resumed = Trainer(build_config(raw_config(tmp_path, small_token_dir, max_steps=11)), callbacks=[])
    resumed._restore()
    assert len(first.spike_guard.losses) == 8
    assert list(resumed.spike_guard.losses) == list(first.spike_guard.losses)
    assert resumed.consecutive_skips.count == first.consecutive_skips.count == 1


def test_a_checkpoint_written_without_the_guard_still_loads(tmp_path, small_token_dir):
    raw = raw_config(tmp_path, small_token_dir, max_steps=4)
    raw["resilience"]["spike_zscore"] = 0.0
    Trainer(build_config(raw), callbacks=[]).fit()
    resumed = Trainer(build_config(raw_config(tmp_path, small_token_dir, max_steps=6)), callbacks=[])
    resumed._restore()
    assert resumed.progress.step == 4 and len(resumed.spike_guard.losses) == 0


def test_weights_with_a_non_finite_heldout_loss_stop_the_cli_before_their_checkpoint(tmp_path, small_token_dir,
                                                                                     capsys):
    # every step is skipped as non-finite, fewer of them than the skip limit: the run used to end with exit 0
    raw = raw_config(tmp_path / "run", small_token_dir, max_steps=3)
    raw["model"]["init_std"] = 1e300
    raw["train"]["ckpt_every"] = 1
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["train", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("optimus train: error: step 3: the held-out loss is nan (the weights give non-finite "
                          "losses; the last 3 optimizer step(s) were skipped)")
    assert "model.init_std" in err and "optim.lr" in err
    # steps 1 and 2 were checkpointed (skipped steps leave the weights as they were); step 3's weights were not
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == ["step-1", "step-2"]
