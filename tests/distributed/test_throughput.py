"""Throughput and MFU logged by the Trainer under tp=2 and pp=2: per device, not tp x pp times it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _train_two_steps(rank: int, world: int, run_dir: str, token_dir: str, parallel: dict):
    import os

    from optimus.config import build_config
    from tests.helpers.runs import tiny_run_config
    from optimus.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # as torchrun would
    train = dict(max_steps=2, ckpt_every=0, global_batch_size=4, dtype="auto")  # 2 micro-batches: enough for pp=2
    config = build_config(tiny_run_config(run_dir, token_dir, train=train, model=dict(n_layers=2), parallel=parallel))
    trainer = Trainer(config, progress_bar=False)
    trainer.fit()
    return trainer.flops_per_token, trainer.peak_flops, trainer.precision.dtype


@pytest.mark.parametrize("parallel", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_mfu_is_per_device_under_model_parallelism(tmp_path, small_token_dir, parallel):
    results = run_distributed(_train_two_steps, 2, str(tmp_path), str(small_token_dir), parallel, timeout=90)
    flops_per_token, peak, dtype = results[0]
    steps = [row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    first = steps[0]
    # the first row says how the figures were obtained: the precision and why, the peak and its source
    assert first["world_size"] == 2 and first["dtype_requested"] == "auto" and first["dtype"] == dtype
    assert first["dtype_reason"] and first["peak_source"] and first["peak_flops_per_device"] == peak
    for row in steps:
        # both ranks compute the same replica's tokens: each device did half the job's work
        assert row["tokens_per_s_per_device"] == pytest.approx(row["tokens_per_s"] / 2)
        # rank 0 gathered every rank's peak memory
        assert len(row["memory_peak_gib"]) == 2 and min(row["memory_peak_gib"]) > 0
        if row["mfu"] is not None:  # None only when the peak was wrong (a >100% figure)
            assert row["mfu"] == pytest.approx(row["tokens_per_s_per_device"] * flops_per_token / peak)
