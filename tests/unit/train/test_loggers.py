"""TensorBoard and W&B (offline) loggers write the metrics of metrics.jsonl under the same names;
asking for one whose package is missing is one line and exit code 2."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import yaml

from optimus.cli import main
from optimus.config import build_config
from optimus.train.config import WandbConfig
from tests.helpers.runs import tiny_run_config
from optimus.train.callbacks import JsonlMetrics, read_metrics
from optimus.train.callbacks.scalars import checkpoint_scalars, eval_scalars, step_scalars
from optimus.train.trainer import Trainer

MOE = dict(n_layers=2, n_experts=4, top_k=2, expert_ffn_hidden=32)
HAS_WANDB = importlib.util.find_spec("wandb") is not None


def _names_in_jsonl(path) -> set[str]:
    names: set[str] = set()
    for record in read_metrics(path):
        if "loss" in record:
            names |= set(step_scalars(record))
        elif "checkpoint_save_s" in record:
            names |= set(checkpoint_scalars(record))
        else:
            names |= set(eval_scalars(record))
    return names


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, small_token_dir):
    """Two MoE steps, evaluated and checkpointed at step 2, with TensorBoard (and W&B when installed)."""
    pytest.importorskip("tensorboard")
    from optimus.train.callbacks.tensorboard import TensorBoardLogger

    run = tmp_path_factory.mktemp("logged")
    config = build_config(tiny_run_config(run, small_token_dir, model=MOE,
                                          train=dict(max_steps=2, eval_every=2, ckpt_every=2)))
    loggers = [TensorBoardLogger(run / "tensorboard")]
    if HAS_WANDB:
        from optimus.train.callbacks.wandb import WandbLogger

        loggers.append(WandbLogger(WandbConfig(project="test"), config, run))
    Trainer(config, callbacks=[JsonlMetrics(run / "metrics.jsonl"), *loggers]).fit()
    return run


def test_tensorboard_writes_every_metric_of_metrics_jsonl(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged_run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = _names_in_jsonl(logged_run / "metrics.jsonl")
    assert tags == expected
    # the report's metrics are among them: memory per rank, expert load per layer, checkpoint and eval
    assert {"train/loss", "train/grad_norm", "train/tokens_per_s", "memory/peak_gib/rank0", "expert_load/layer1/max",
            "expert_load/layer1/min", "checkpoint/save_s", "eval/loss"} <= tags
    records = read_metrics(logged_run / "metrics.jsonl")
    steps = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(s, pytest.approx(v)) for s, v in steps]
    # each at the step it was logged at, evaluations and checkpoints too
    assert [e.step for e in events.Scalars("eval/loss")] == [r["step"] for r in records if "eval_loss" in r]
    assert [e.step for e in events.Scalars("checkpoint/save_s")] == [r["step"] for r in records
                                                                      if "checkpoint_save_s" in r]


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install 'optimus[loggers]')")
def test_wandb_writes_an_offline_run_with_the_same_names(logged_run):
    (offline,) = (logged_run / "wandb").glob("offline-run-*/run-*.wandb")  # offline: never synced anywhere
    data = offline.read_bytes()
    missing = [name for name in sorted(_names_in_jsonl(logged_run / "metrics.jsonl")) if name.encode() not in data]
    assert not missing


@pytest.mark.parametrize("setting, package", [({"tensorboard": True}, "tensorboard"),
                                              ({"wandb": {"project": "p"}}, "wandb")])
def test_a_logger_without_its_package_is_one_line_and_exit_2(tmp_path, small_token_dir, monkeypatch, capsys,
                                                              setting, package):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard" if package == "tensorboard" else package, None)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_run_config(tmp_path / "run", small_token_dir, train=setting)))
    assert main(["train", str(config), "--no-progress"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("optimus")]
    assert len(err) == 1 and f"needs the {package} package" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_expert_load_scalars_are_each_layers_counts_over_its_even_share():
    """Layer 0: 6 of 8 copies on expert 0 of 4 (even share 2: 3.0x), none on experts 2 and 3 (0.0x); layer 1 even."""
    scalars = step_scalars({"step": 1, "loss": 2.0, "expert_counts": [[6, 2, 0, 0], [2, 2, 2, 2]]})
    assert scalars["expert_load/layer0/max"] == 3.0 and scalars["expert_load/layer0/min"] == 0.0
    assert scalars["expert_load/layer1/max"] == scalars["expert_load/layer1/min"] == 1.0
    assert scalars["train/loss"] == 2.0


def test_step_scalars_are_the_records_numbers_but_its_step_and_skip_a_layer_that_routed_nothing():
    """Integers (tokens_seen, a bool flag) are numbers too; the step is the x axis, not a scalar; text is left out;
    a layer whose counts are all 0 has no even share to divide by."""
    scalars = step_scalars({"step": 3, "loss": 2.5, "tokens_seen": 100, "skipped": False, "dtype": "bf16",
                            "memory_peak_gib": [1.5, 2.0], "expert_counts": [[3, 1], [0, 0]]})
    assert scalars == {"train/loss": 2.5, "train/tokens_seen": 100.0, "train/skipped": 0.0,
                       "memory/peak_gib/rank0": 1.5, "memory/peak_gib/rank1": 2.0,
                       "expert_load/layer0/max": 1.5, "expert_load/layer0/min": 0.5}
