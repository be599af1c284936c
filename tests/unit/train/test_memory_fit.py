"""The trainer's memory check before the build (train/memory_fit.py): the planner's peak against what a rank has."""

from __future__ import annotations

import pytest
import torch
import yaml

from optimus.cli import main
from optimus.config import build_config
from optimus.parallel.mesh import ParallelDims
from optimus.parallel.validate import validate_layout
from optimus.train import memory_fit
from optimus.train.memory_fit import MemoryFitError, available_bytes, check_memory_fits, predicted_peak_bytes
from tests.helpers.runs import tiny_run_config

CPU = torch.device("cpu")
GIB = 2**30


def layout(tmp_path, token_dir, **train):
    resolved = validate_layout(build_config(tiny_run_config(tmp_path / "run", token_dir, train=train)), 1)
    return resolved.config, resolved.dims


def test_a_layout_within_the_memory_passes_and_returns_its_prediction(tmp_path, small_token_dir, monkeypatch):
    config, dims = layout(tmp_path, small_token_dir)
    monkeypatch.setattr(memory_fit, "available_bytes", lambda device, ranks: 64 * GIB)
    assert check_memory_fits(config, dims, CPU, 1) == predicted_peak_bytes(config, dims, CPU) > 0


def test_too_large_a_micro_batch_is_refused_with_the_largest_that_fits(tmp_path, small_token_dir, monkeypatch):
    # derived micro-batch: 96 sequences, long enough for the activations to outweigh the accumulated gradients
    config, dims = layout(tmp_path, small_token_dir, micro_batch_size=None, global_batch_size=96, seq_len=1024)
    peaks = {micro: predicted_peak_bytes(config.model_copy(update={"train": config.train.model_copy(
        update={"micro_batch_size": micro})}), dims, CPU) for micro in (96, 48, 32, 24)}
    assert peaks[96] > peaks[48] > peaks[32] > peaks[24]
    room = (peaks[32] + peaks[48]) / 2  # 32 fits, 48 does not
    monkeypatch.setattr(memory_fit, "available_bytes", lambda device, ranks: room)
    with pytest.raises(MemoryFitError) as refused:
        check_memory_fits(config, dims, CPU, 1)
    message = str(refused.value)
    assert "set train.micro_batch_size=32 (accumulating 3 micro-batches a step)" in message
    assert "train.memory_check=false" in message and "\n" not in message


def test_without_a_smaller_micro_batch_the_memory_knobs_are_named(tmp_path, small_token_dir, monkeypatch):
    config, dims = layout(tmp_path, small_token_dir, micro_batch_size=1, global_batch_size=1)
    monkeypatch.setattr(memory_fit, "available_bytes", lambda device, ranks: 1024.0)
    with pytest.raises(MemoryFitError, match="lower train.seq_len, set train.activation_checkpointing=full, shard"):
        check_memory_fits(config, dims, CPU, 1)


def test_an_unreadable_memory_size_never_refuses(tmp_path, small_token_dir, monkeypatch):
    config, dims = layout(tmp_path, small_token_dir)
    monkeypatch.setattr(memory_fit, "available_bytes", lambda device, ranks: None)
    assert check_memory_fits(config, dims, CPU, 1) > 0


def write_host(root, available_kib, limit=None, usage=None, v1=False):
    (root / "proc").mkdir(parents=True)
    (root / "proc/meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_kib} kB\n")
    if limit is not None:
        cgroup = root / ("sys/fs/cgroup/memory" if v1 else "sys/fs/cgroup")
        cgroup.mkdir(parents=True)
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes") if v1 else ("memory.max", "memory.current")
        (cgroup / names[0]).write_text(f"{limit}\n")
        (cgroup / names[1]).write_text(f"{usage}\n")


@pytest.mark.parametrize("limit, usage, v1, expected", [
    (None, None, False, 8 * GIB),  # no cgroup files: MemAvailable
    ("max", 5, False, 8 * GIB),  # cgroup v2 without a limit
    (3 * GIB, GIB, False, 2 * GIB),  # a job's cgroup v2 limit below the host's: what is left of it
    (3 * GIB, GIB, True, 2 * GIB),  # the same under cgroup v1
    (GIB, 2 * GIB, False, 0.0),  # already past its limit
])
def test_host_memory_is_the_lower_of_the_host_and_the_job_cgroup(tmp_path, limit, usage, v1, expected):
    write_host(tmp_path, 8 * GIB // 1024, limit, usage, v1)
    assert memory_fit._host_available_bytes(tmp_path) == expected


def test_the_host_memory_is_shared_by_the_node_ranks(monkeypatch):
    monkeypatch.setattr(memory_fit, "_host_available_bytes", lambda: 8.0 * GIB)
    assert available_bytes(CPU, 4) == 2 * GIB


def test_train_refuses_a_batch_no_memory_holds_before_writing_anything(tmp_path, small_token_dir, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_run_config(tmp_path / "run", small_token_dir, train=dict(
        micro_batch_size=None, global_batch_size=100_000_000))))
    assert main(["train", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("optimus train: error: this layout needs about ")
    assert "set train.micro_batch_size=" in err
    assert not (tmp_path / "run").exists()


def test_memory_check_false_skips_the_check(tmp_path, small_token_dir, monkeypatch):
    monkeypatch.setattr(memory_fit, "available_bytes", lambda device, ranks: 1024.0)
    raw = tiny_run_config(tmp_path / "run", small_token_dir, train=dict(max_steps=1, memory_check=False))
    from optimus.train.trainer import Trainer

    trainer = Trainer(build_config(raw), callbacks=[])
    assert trainer.planned_peak_bytes is None
    assert trainer.fit().step == 1


def test_an_accelerator_offers_its_free_memory_not_its_total(monkeypatch):
    """Another process (or a job before this one) may hold part of the device: the check uses what is free."""
    gib = 1024**3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * gib, 80 * gib))
    assert available_bytes(torch.device("cuda", 0), 1) == 3 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (_ for _ in ()).throw(RuntimeError("no")))
    assert available_bytes(torch.device("cuda", 0), 1) is None  # a backend that cannot tell: no check


def test_a_peak_equal_to_the_memory_fits(tmp_path, small_token_dir, monkeypatch):
    """Refused only when the peak exceeds what the rank has."""
    config, dims = layout(tmp_path, small_token_dir)
    predicted = predicted_peak_bytes(config, dims, CPU)
    monkeypatch.setattr(memory_fit, "available_bytes", lambda device, ranks: predicted)
    assert check_memory_fits(config, dims, CPU, 1) == predicted


def test_the_largest_fitting_candidate_is_found_at_either_end():
    fits_up_to = lambda limit: (lambda m: m <= limit)  # noqa: E731
    candidates = [1, 2, 3, 4, 6, 8, 12]
    assert [memory_fit._largest_fitting(candidates, fits_up_to(limit)) for limit in (0, 1, 5, 11, 12, 99)] == [
        None, 1, 4, 8, 12, 12]
    assert memory_fit._largest_fitting([], fits_up_to(99)) is None


def test_fully_checkpointed_activations_are_not_suggested_again(tmp_path, small_token_dir, monkeypatch):
    config, dims = layout(tmp_path, small_token_dir, micro_batch_size=1, global_batch_size=1,
                          activation_checkpointing="full")
    monkeypatch.setattr(memory_fit, "available_bytes", lambda device, ranks: 1024.0)
    with pytest.raises(MemoryFitError) as refused:
        check_memory_fits(config, dims, CPU, 1)
    assert "lower train.seq_len, shard over more ranks" in str(refused.value)
    assert "activation_checkpointing" not in str(refused.value)


def test_under_pipeline_parallelism_no_micro_batch_is_suggested(tmp_path, small_token_dir, monkeypatch):
    """A pipeline schedule constrains the micro-batches (at least pp of them): the memory knobs are named instead,
    even where a smaller micro-batch would fit."""
    raw = tiny_run_config(tmp_path / "run", small_token_dir, model=dict(n_layers=2), parallel=dict(pp=2),
                          train=dict(micro_batch_size=4, global_batch_size=16))
    resolved = validate_layout(build_config(raw), 2)
    config, dims = resolved.config, resolved.dims
    one = config.model_copy(update={"train": config.train.model_copy(update={"micro_batch_size": 1})})
    room = predicted_peak_bytes(one, dims, CPU)  # micro-batches of 1 would fit, of 4 not
    assert room < predicted_peak_bytes(config, dims, CPU)
    monkeypatch.setattr(memory_fit, "available_bytes", lambda device, ranks: room)
    with pytest.raises(MemoryFitError) as refused:
        check_memory_fits(config, dims, CPU, 2)
    assert "lower train.micro_batch_size or train.seq_len" in str(refused.value)
    assert "set train.micro_batch_size=" not in str(refused.value)
