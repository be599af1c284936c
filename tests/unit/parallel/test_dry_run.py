"""Dry run at scale: the Mula presets at the Optimus paper's layouts give plausible per-rank figures,
quickly, and the CLI prints the table."""

from __future__ import annotations

import time

import pytest

from optimus.config import build_config
from optimus.parallel.dry_run import dry_run, format_report
from optimus.parallel.mesh import ParallelDims
from tests.helpers import in_forked_process

TRAIN = dict(seq_len=4096, micro_batch_size=1, global_batch_size=1536, dtype="bf16", activation_checkpointing="full")


PAPER_LAYOUTS = [
    ("mula-1b", dict(dp_shard=384), 384, 1536),
    ("mula-7b-a1b", dict(dp_shard=256, ep=8), 256, 1536),  # not in the paper's table: the OLMoE-sized member
    ("mula-20b-a2b", dict(dp_shard=384, ep=12), 384, 1536),
    ("mula-100b-a7b", dict(dp_shard=96, ep=12, pp=4), 384, 1536),
    # 1F1B over 8 stages needs 8 micro-batches per rank: 384 data-parallel ranks x 8
    ("mula-220b-a10b", dict(dp_shard=384, ep=12, pp=8), 3072, 3072),
]


@pytest.mark.parametrize("preset, parallel, world, global_batch", PAPER_LAYOUTS)
@in_forked_process  # builds a fake process group: keep it out of this process
def test_paper_layouts_give_plausible_per_rank_memory(preset, parallel, world, global_batch):
    config = build_config({"model": {"preset": preset}, "parallel": parallel,
                           "train": {**TRAIN, "global_batch_size": global_batch}})
    start = time.monotonic()
    report = dry_run(config, world, device_memory_gb=64)
    assert time.monotonic() - start < 20
    fair_share = report.total_parameters / world
    for rank in report.ranks:
        # each rank holds at least its fair share and, with shard padding, not much more
        assert fair_share <= rank.parameters <= 2 * fair_share + 2e7, (rank.parameters, fair_share)
        assert rank.bytes["optimizer (AdamW, 2 x fp32)"] == 2 * rank.bytes["parameters (fp32)"]
        assert 0 < rank.total < 64 * 1024**3
    assert len(report.ranks) == (2 if parallel.get("pp", 1) > 1 else 1)
    table = format_report(report)
    assert "total" in table and "fits" in table


@in_forked_process  # builds a fake process group: keep it out of this process
def test_pipeline_stages_hold_their_share_of_layers():
    config = build_config({"model": {"preset": "mula-100b-a7b"}, "parallel": dict(dp_shard=96, ep=12, pp=4),
                           "train": TRAIN})
    report = dry_run(config, 384)
    assert [r.layers for r in report.ranks] == [12, 12]
    assert [r.in_flight for r in report.ranks] == [4, 1]  # 1F1B: the first stage holds pp micro-batches


@in_forked_process  # builds a fake process group: keep it out of this process
def test_dry_run_lists_every_checkpointing_mode():
    config = build_config({"model": {"preset": "mula-tiny-moe"}, "parallel": dict(dp_shard=2),
                           "train": dict(activation_checkpointing="selective", recompute=["attention", "moe"])})
    report = dry_run(config, 2)
    assert list(report.ranks[0].activations_per_micro_batch) == ["none", "selective attention+moe", "selective_ops", "full"]
    table = format_report(report)
    assert "ckpt selective attention+moe" in table and "activation checkpointing selective (attention+moe)" in table


@in_forked_process  # builds a fake process group: keep it out of this process
def test_cli_dry_run_with_world_size_prints_config_and_table(capsys):
    from optimus.cli import main

    code = main(["train", "configs/mula-tiny-moe.yaml", "--dry-run", "--world-size", "8",
                 "--parallel.dp_shard=4", "--parallel.tp=2", "--parallel.ep=2", "--device-memory-gb", "16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "preset: mula-tiny-moe" in out  # the resolved config still comes first
    assert "dry run: mula-tiny-moe" in out and "vs 16 GiB device" in out


def _optimus(argv: list[str]) -> tuple[int, str, str]:
    """`optimus ARGV` as main() in a forked child (a dry run may build a fake process group): (code, out, err)."""
    import contextlib
    import io

    import torch

    from optimus.cli import main
    from tests.helpers import run_forked

    def child():
        torch.set_num_threads(1)  # a forked child of a multi-threaded parent: see CPU-NOTES
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        return code, out.getvalue(), err.getvalue()

    return run_forked(child)


def test_dry_run_refuses_what_the_trainer_refuses(tmp_path):
    """pp=2 with one micro-batch per step: the trainer stops at step 1; the dry run used to approve it.
    Both now give the same one line, exit code 2, and nothing is written (main() in a forked child rather
    than two `python -m optimus` processes: ~10 s of start-up saved; the e2e tests run the real processes)."""
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[3] / "configs" / "mula-tiny-moe.yaml")
    flags = ["--parallel.pp=2", "--train.micro_batch_size=8", f"--run.dir={tmp_path / 'run'}"]
    dry = _optimus(["train", config, *flags, "--dry-run", "--world-size", "2"])
    train = _optimus(["train", config, *flags])
    for code, _, err in (dry, train):
        assert code == 2, err
        assert err.strip().endswith("micro-batches per step, got 1 (train.global_batch_size / "
                                    "(data-parallel ranks x train.micro_batch_size)): use smaller "
                                    "micro-batches, a larger global batch, or pp_schedule=gpipe")
    assert dry[2] == train[2] and dry[1] == "" and len(dry[2].strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@in_forked_process  # builds a fake process group: keep it out of this process
def test_dry_run_derives_the_micro_batch_as_the_trainer_does():
    config = build_config({"model": {"preset": "mula-tiny-moe"}, "parallel": dict(pp=2),
                           "train": dict(global_batch_size=8)})
    report = dry_run(config, 2)
    assert report.batch.micro_batch_size == 4 and report.batch.micro_batches == 2
    assert [r.in_flight for r in report.ranks] == [2, 1]
    assert "2 micro-batch(es) of 4 per step (derived" in format_report(report)


def test_fsdp_under_pp_reduces_unit_by_unit_holding_the_two_largest_units_copies():
    from optimus.parallel.dry_run import fsdp_deferred_reduce_bytes

    pp = ParallelDims(world_size=4, dp_shard=2, pp=2)
    assert fsdp_deferred_reduce_bytes([3.0, 5.0, 1.0], 4.0, pp) == 4.0 * (5.0 + 4.0)
    assert fsdp_deferred_reduce_bytes([3.0, 5.0], 4.0, ParallelDims(world_size=2, dp_shard=2)) == 0.0  # no pp
    assert fsdp_deferred_reduce_bytes([3.0, 5.0], 4.0, ParallelDims(world_size=2, pp=2)) == 0.0  # no FSDP


@in_forked_process  # builds a fake process group: keep it out of this process
def test_fsdp_under_pp_never_holds_the_sharded_gradients_with_the_activations():
    """FSDP under pp reduces once, after the stage's last backward: the peak is the activations' (no sharded
    gradients yet) or the reduce-scatters' (flat copies of unsharded gradients, no activations left)."""
    from optimus.parallel.dry_run import OVERLAP_LABEL

    config = build_config({"model": {"preset": "mula-tiny-moe"}, "parallel": dict(dp_shard=2, ep=2, pp=2),
                           "train": dict(global_batch_size=8, micro_batch_size=2, seq_len=128, dtype="fp32")})
    first, last = dry_run(config, 4).ranks
    # the last stage peaks inside the loss: what comes off is exactly the sharded gradients
    assert last.bytes["activations (as configured)"] > 0
    assert -last.bytes[OVERLAP_LABEL] == pytest.approx(last.bytes["gradients (fp32)"])
    # the first stage (few activations) peaks in its reduce: less comes off than gradients + activations
    taken_off = -first.bytes[OVERLAP_LABEL]
    assert 0 < taken_off < first.bytes["gradients (fp32)"] + first.bytes["activations (as configured)"]
    # without pp, two micro-batches a step: their activations meet the gradients, nothing comes off
    flat = dry_run(build_config({**config.model_dump(), "parallel": dict(dp_shard=2, ep=2)}), 2)
    assert OVERLAP_LABEL not in flat.ranks[0].bytes


def test_fsdp_without_pp_peaks_in_the_roots_reduce_when_it_outweighs_the_activations():
    """The root's reduce at the end of the backward meets every sharded gradient but no activations and no
    transient: the peak is the larger of that phase and the activations' (gradients 1, activations 3, transient 2)."""
    from optimus.parallel.dry_run import fsdp_root_reduce_bytes, gradients_not_at_the_activation_peak

    assert gradients_not_at_the_activation_peak(1, 1.0, 3.0) == 1.0  # without it: the smaller comes off
    assert gradients_not_at_the_activation_peak(1, 1.0, 3.0, root_reduce=1.0, transient=2.0) == 1.0  # 2 + 3 > 1 + 1
    # 1 + 5 > 2 + 3: the reduce phase holds 6 of what the sum counts as 2 + 1 + 3, so nothing comes off
    assert gradients_not_at_the_activation_peak(1, 1.0, 3.0, root_reduce=5.0, transient=2.0) == 0.0
    assert gradients_not_at_the_activation_peak(1, 1.0, 3.0, root_reduce=7.0, transient=2.0) == -2.0  # adds
    fsdp = ParallelDims(world_size=2, dp_shard=2)
    assert fsdp_root_reduce_bytes(10.0, fsdp) == 40.0  # the flat fp32 reduce-scatter input
    assert fsdp_root_reduce_bytes(10.0, fsdp, loss_weight_gradient=5.0, gloo=True) == 85.0  # gloo's copy, the loss's
    assert fsdp_root_reduce_bytes(10.0, ParallelDims(world_size=4, dp_shard=2, pp=2)) == 0.0  # pp: deferred instead
    # replicating only (dp_shard 1): FSDP2 copies the input to a whole-sized output, no gloo reduce-scatter
    replicate = ParallelDims(world_size=2, dp_replicate=2)
    assert fsdp_root_reduce_bytes(10.0, replicate, loss_weight_gradient=5.0, gloo=True) == 45.0
    assert fsdp_root_reduce_bytes(10.0, ParallelDims(world_size=2, tp=2)) == 0.0  # no FSDP


def test_gradients_dropped_in_every_backward_never_meet_a_later_micro_batchs_activations():
    """zero2 reduces its buckets and drops the whole gradients in every backward: summing two micro-batches, the
    second one's activation peak holds none of them (the smaller of the two comes off, as with one micro-batch);
    gradients kept between backwards meet it (nothing comes off)."""
    from optimus.parallel.dry_run import gradients_not_at_the_activation_peak

    assert gradients_not_at_the_activation_peak(2, 1.0, 3.0) == 0.0
    assert gradients_not_at_the_activation_peak(2, 1.0, 3.0, kept_between_backwards=False) == 1.0


def test_hsdp_summing_micro_batches_holds_the_last_backwards_shards_beside_the_gradients():
    from optimus.parallel.dry_run import hsdp_last_shards_bytes

    def config(**parallel):
        return build_config({"parallel": parallel})

    hsdp = ParallelDims(world_size=4, dp_replicate=2, dp_shard=2)
    assert hsdp_last_shards_bytes(config(), hsdp, 2, 10.0) == 40.0  # one fp32 shard of every unit
    assert hsdp_last_shards_bytes(config(defer_grad_sync="none"), hsdp, 2, 10.0) == 40.0
    assert hsdp_last_shards_bytes(config(grad_reduce_dtype="bf16"), hsdp, 2, 10.0) == 20.0
    assert hsdp_last_shards_bytes(config(), hsdp, 1, 10.0) == 0.0  # one micro-batch: the shards are the gradients
    assert hsdp_last_shards_bytes(config(defer_grad_sync="all"), hsdp, 2, 10.0) == 0.0  # reduced once, in the last
    assert hsdp_last_shards_bytes(config(), ParallelDims(world_size=2, dp_shard=2), 2, 10.0) == 0.0  # no all-reduce
    assert hsdp_last_shards_bytes(config(), ParallelDims(world_size=8, dp_replicate=2, dp_shard=2, pp=2), 2, 10.0) == 0
    assert hsdp_last_shards_bytes(config(shard_mode="zero1"), hsdp, 2, 10.0) == 0.0


def test_fsdp_summing_micro_batches_holds_the_roots_fresh_shard_beside_its_gradients():
    """A later micro-batch's reduce makes a fresh output and adds it to the gradients the earlier ones left: the
    root's reduce holds one more root shard, in the reduce dtype (FSDP over dp_shard alone)."""
    from optimus.parallel.dry_run import fsdp_reduce_accumulates, fsdp_root_reduce_bytes

    def config(**parallel):
        return build_config({"parallel": parallel})

    fsdp = ParallelDims(world_size=2, dp_shard=2)
    assert fsdp_reduce_accumulates(config(), fsdp, 2)
    assert fsdp_reduce_accumulates(config(defer_grad_sync="replicate"), fsdp, 2)  # nothing to defer without HSDP
    assert not fsdp_reduce_accumulates(config(), fsdp, 1)  # one micro-batch: the output becomes the gradients
    assert not fsdp_reduce_accumulates(config(defer_grad_sync="all"), fsdp, 2)  # one reduce a step, into nothing
    assert not fsdp_reduce_accumulates(config(), ParallelDims(world_size=4, dp_replicate=2, dp_shard=2), 2)  # HSDP's
    assert not fsdp_reduce_accumulates(config(), ParallelDims(world_size=4, dp_shard=2, pp=2), 2)  # pp: deferred
    assert not fsdp_reduce_accumulates(config(shard_mode="zero1"), fsdp, 2)
    assert not fsdp_reduce_accumulates(config(), ParallelDims(world_size=2, tp=2), 2)  # no FSDP
    # 10 root elements over 2 ranks: input 40 + gloo's copy 40 + the loss's 5 + a fresh fp32 shard 20 (bf16: 10)
    assert fsdp_root_reduce_bytes(10.0, fsdp, loss_weight_gradient=5.0, gloo=True, accumulating=True) == 105.0
    assert fsdp_root_reduce_bytes(10.0, fsdp, reduce=2.0, accumulating=True) == 30.0


def test_summing_under_pp_in_another_dtype_holds_fresh_gradients_and_the_adds_temporaries():
    """A bf16 sum of fp32 gradients: the larger unit's fresh fp32 gradients and two fp32 temporaries of the largest
    tensor (an fp32 sum of bf16 ones: one); nothing where the dtypes agree, without pp or without FSDP."""
    from optimus.parallel.dry_run import fsdp_accumulate_cast_bytes

    piped = ParallelDims(world_size=4, dp_shard=2, pp=2)
    assert fsdp_accumulate_cast_bytes([10.0, 12.0], 20.0, 8.0, 4, piped, reduce=2.0) == 4 * 20 + 2 * 4 * 8
    assert fsdp_accumulate_cast_bytes([10.0, 12.0], 20.0, 8.0, 2, piped, reduce=4.0) == 2 * 20 + 4 * 8
    assert fsdp_accumulate_cast_bytes([10.0, 12.0], 20.0, 8.0, 4, piped, reduce=4.0) == 0.0
    assert fsdp_accumulate_cast_bytes([10.0], 20.0, 8.0, 4, ParallelDims(world_size=2, dp_shard=2), reduce=2.0) == 0
    assert fsdp_accumulate_cast_bytes([10.0], 20.0, 8.0, 4, ParallelDims(world_size=2, pp=2), reduce=2.0) == 0.0


def test_deferring_every_reduction_holds_whole_gradients_at_the_later_micro_batches_peak():
    from optimus.parallel.dry_run import fsdp_accumulated_beyond_shards_bytes

    defer_all = build_config({"parallel": {"defer_grad_sync": "all"}})
    hsdp = ParallelDims(world_size=4, dp_replicate=2, dp_shard=2)
    # whole fp32 gradients of two blocks of 10 and a root of 5 elements, beyond a 15-element fp32 shard
    assert fsdp_accumulated_beyond_shards_bytes(defer_all, hsdp, 2, [10.0, 10.0], 5.0, 15.0) == 4.0 * 25 - 4.0 * 15
    assert fsdp_accumulated_beyond_shards_bytes(defer_all, hsdp, 1, [10.0, 10.0], 5.0, 15.0) == 0.0
    assert fsdp_accumulated_beyond_shards_bytes(build_config({}), hsdp, 2, [10.0, 10.0], 5.0, 15.0) == 0.0
    piped = ParallelDims(world_size=8, dp_replicate=2, dp_shard=2, pp=2)  # under pp: the FSDP transient's
    assert fsdp_accumulated_beyond_shards_bytes(defer_all, piped, 2, [10.0, 10.0], 5.0, 15.0) == 0.0
