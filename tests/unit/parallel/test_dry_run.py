"""Dry run at scale: the Mula presets at the Optimus paper's layouts give plausible per-rank figures,
quickly, and the CLI prints the table."""

from __future__ import annotations

import time

import pytest

from optimus.config import build_config
from optimus.parallel.activation_memory import (activation_bytes, activation_split, loss_head_bytes,
                                               rank_activation_bytes, stream_width)
from optimus.parallel.dry_run import dry_run, format_report
from optimus.parallel.mesh import ParallelDims
from tests.helpers import in_forked_process
from tests.helpers.precision import cpu_auto_dtype

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


def test_activation_estimate_orders_checkpointing_modes():
    dims = ParallelDims(world_size=1)
    sizes = {}
    for mode in ("none", "selective_ops", "full"):
        config = build_config({"model": {"preset": "mula-1b"}, "train": {**TRAIN, "activation_checkpointing": mode}})
        sizes[mode] = activation_bytes(config, dims, layers=16, has_loss_head=False)
    assert sizes["full"] < sizes["selective_ops"] < sizes["none"]


def test_activation_estimate_of_the_selective_mask():
    """Each sub-module added to train.recompute lowers the estimate; recomputing all of it approaches full."""
    dims = ParallelDims(world_size=1)

    def size(mode: str, recompute=("moe",)) -> float:
        train = {**TRAIN, "activation_checkpointing": mode, "recompute": list(recompute)}
        return activation_bytes(build_config({"model": {"preset": "mula-7b-a1b"}, "train": train}), dims, 16, False)

    none, full = size("none"), size("full")
    masks = [["moe"], ["moe", "norms"], ["attention", "moe", "norms"]]
    sizes = [size("selective", mask) for mask in masks]
    assert none > sizes[0] > sizes[1] > sizes[2] > full
    assert sizes[2] < 2 * full  # every sub-module recomputed: block inputs (and norm inputs) only
    # a dense model's default mask recomputes its MLP
    dense = {"model": {"preset": "mula-1b"}, "train": {**TRAIN, "activation_checkpointing": "selective"}}
    plain = {"model": {"preset": "mula-1b"}, "train": {**TRAIN, "activation_checkpointing": "none"}}
    assert build_config(dense).train.recompute == ["mlp"]
    assert activation_bytes(build_config(dense), dims, 16, False) < activation_bytes(build_config(plain), dims, 16, False)


@in_forked_process  # builds a fake process group: keep it out of this process
def test_dry_run_lists_every_checkpointing_mode():
    config = build_config({"model": {"preset": "mula-tiny-moe"}, "parallel": dict(dp_shard=2),
                           "train": dict(activation_checkpointing="selective", recompute=["attention", "moe"])})
    report = dry_run(config, 2)
    assert list(report.ranks[0].activations_per_micro_batch) == ["none", "selective attention+moe", "selective_ops", "full"]
    table = format_report(report)
    assert "ckpt selective attention+moe" in table and "activation checkpointing selective (attention+moe)" in table


def test_micro_batches_in_flight_keep_their_saved_tensors_but_one_recompute_working_set():
    """Under recompute only the micro-batch in its backward rebuilds a block: a first pipeline stage with 128
    micro-batches in flight holds 128 block inputs, not 128 recomputed blocks (Frontier's 1T layout read 143 GiB
    per GCD when it did; the Frontier team ran it on 64 GB GCDs)."""
    for mode in ("full", "selective", "none"):
        config = build_config({"model": {"preset": "mula-1b"}, "train": {**TRAIN, "activation_checkpointing": mode}})
        dims = ParallelDims(pp=4, dp_shard=2, world_size=8)
        kept, once = activation_split(config, dims, 4, has_loss_head=False)
        assert activation_bytes(config, dims, 4, False) == kept + once
        assert rank_activation_bytes(config, dims, 4, False, in_flight=8) == 8 * kept + once
        assert (once > 0) == (mode != "none")
    kept, once = activation_split(config, dims, 4, has_loss_head=True)  # the loss's backward buffers: once
    assert once == loss_head_bytes(config, dims, TRAIN["seq_len"] * TRAIN["micro_batch_size"], False)[1] > 0


@pytest.mark.parametrize("loss_on_cpu", [True, False], ids=["cpu-loss", "accelerator-loss"])
def test_the_loss_head_keeps_one_micro_batch_but_under_gpipe(loss_on_cpu):
    """The fused loss forms its weight gradient in the forward and keeps it until the backward (4 V h a micro-batch
    on CPU, beside the head's input): the last stage holds it once where forward and backward alternate (1F1B,
    interleaved: the head is in its last virtual stage), and for every micro-batch under GPipe, whose forwards all
    run first (dense PP 2 GPipe on the 2-core EPYC: 481 MiB measured, 387 predicted when it counted once)."""
    from optimus.parallel.activation_memory import head_kept_bytes

    dims = ParallelDims(pp=2, world_size=2)
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        config = build_config({"model": {"preset": "mula-tiny-dense"},
                               "train": {"seq_len": 128, "micro_batch_size": 2, "global_batch_size": 8},
                               "parallel": {"pp": 2, "pp_schedule": schedule, "pp_virtual_stages": virtual}})
        kept, once = activation_split(config, dims, 2, has_loss_head=True, loss_on_cpu=loss_on_cpu)
        head = head_kept_bytes(config, dims, loss_on_cpu)
        held = rank_activation_bytes(config, dims, 2, True, in_flight=4, loss_on_cpu=loss_on_cpu)
        assert held == pytest.approx(4 * kept + once if schedule == "gpipe" else 4 * (kept - head) + head + once)
    # and GPipe's activation peak, after every forward, meets no gradient, as one micro-batch's does
    from optimus.parallel.dry_run import gradients_not_at_the_activation_peak

    assert gradients_not_at_the_activation_peak(4, 60.0, 500.0, forwards_first=True) == 60.0
    assert gradients_not_at_the_activation_peak(4, 60.0, 500.0) == 0.0
    m, tokens = config.model, 2 * 128
    weight_gradient = 4 * m.vocab_size * m.d_model if loss_on_cpu else 0
    # the head's input, the final norm's fp32 input and normed value (the stream is fp32: pp alone keeps fp32 weights)
    assert stream_width(config, dims) == 4
    assert head == tokens * m.d_model * (4 + 8) + loss_head_bytes(config, dims, tokens, loss_on_cpu)[0]
    assert loss_head_bytes(config, dims, tokens, loss_on_cpu)[0] == (weight_gradient or 4 * tokens * m.vocab_size)


_CPU_LOSS_PEAK = """
import sys, torch
from pathlib import Path
from optimus.ops.cross_entropy import linear_cross_entropy
n, h, vocab, bf16 = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "bf16"
x = torch.randn(n, h, requires_grad=True)
weight = torch.randn(vocab, h, requires_grad=True)
labels = torch.randint(0, vocab, (n,))
with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # warm-up: the op's one-time set-up
    linear_cross_entropy(x[:8], weight, labels[:8]).backward()
x.grad = weight.grad = None
status = lambda key: int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key)).split()[1])
Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
base = status("VmRSS")
with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
    loss = linear_cross_entropy(x, weight, labels)
loss.backward()
print((status("VmHWM") - base) * 1024)
"""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_loss_head_bytes_match_what_the_cpu_loss_allocates(dtype):
    """The CPU loss kernel's peak (a fresh process's resident-set growth: its buffers live inside one op, out of
    reach of tensor-level trackers) against activation_memory.loss_head_bytes: one [512, V] chunk buffer and the fp32 weight
    gradient (and under bf16 its partial products), plus the head input's gradient it keeps, plus what backward
    hands the input and the weight (their .grad). Sizes where the chunk buffer dominates."""
    import subprocess
    import sys

    if dtype == "bf16" and cpu_auto_dtype() != "bf16":
        pytest.skip("bf16 matmuls crawl on a CPU without native bf16 (AVX2)")
    n, h, vocab = 1024, 64, 32768
    out = subprocess.run([sys.executable, "-c", _CPU_LOSS_PEAK, str(n), str(h), str(vocab), dtype],
                         capture_output=True, text=True, check=True)
    measured = int(out.stdout.split()[-1])
    config = build_config({"model": {"preset": "mula-tiny-dense", "vocab_size": vocab, "d_model": h},
                           "train": {"seq_len": n, "micro_batch_size": 1, "global_batch_size": 1, "dtype": dtype}})
    kept, once = loss_head_bytes(config, ParallelDims(world_size=1), n, loss_on_cpu=True)
    width = 2 if dtype == "bf16" else 4
    input_grads = (n * h + vocab * h) * 4
    # blind spots of a resident-set reading: the op's input (once counts it: the final norm's output, alive at the
    # op's forward) was allocated before the reading starts, and the head weight's bf16 cast reuses the pages the
    # warm-up's cast of the same size freed (the allocator's peak counts both: BENCHMARKS, stop 29)
    unseen = n * h * 4 + (2 * vocab * h if dtype == "bf16" else 0)
    assert measured == pytest.approx(kept + once - unseen + n * h * width + input_grads, rel=0.1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_loss_head_bytes_match_what_the_plain_loss_allocates(dtype):
    """The accelerators' plain path (F.cross_entropy over fp32 logits), tracked tensor by tensor (torch's
    MemTracker, device-independent): the fp32 log-softmax kept for backward and the two [n, V] fp32 gradients its
    backward holds with it, against activation_memory.loss_head_bytes."""
    import torch

    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    from optimus.ops.cross_entropy import linear_cross_entropy_reference

    n, h, vocab = 1024, 64, 8192
    config = build_config({"model": {"preset": "mula-tiny-dense", "vocab_size": vocab, "d_model": h},
                           "train": {"seq_len": n, "micro_batch_size": 1, "global_batch_size": 1, "dtype": dtype}})
    x = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(vocab, h, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
    tracker = mem_tracker.MemTracker()
    tracker.track_external(x, weight)
    with tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = linear_cross_entropy_reference(x, weight, labels)
        loss.backward()
    peak = sum(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
    inputs = (x.numel() + weight.numel()) * 4
    kept, once = loss_head_bytes(config, ParallelDims(world_size=1), n, loss_on_cpu=False)
    width = 2 if dtype == "bf16" else 4
    assert peak - inputs == pytest.approx(kept + once + n * h * width, rel=0.1)


def test_tensor_parallel_splits_activations():
    config = build_config({"model": {"preset": "mula-1b"}, "train": {**TRAIN, "activation_checkpointing": "none"}})
    one = activation_bytes(config, ParallelDims(world_size=1), 16, False)
    two = activation_bytes(config, ParallelDims(tp=2, world_size=2), 16, False)
    assert 0.5 * one < two < one


@in_forked_process  # builds a fake process group: keep it out of this process
def test_cli_dry_run_with_world_size_prints_config_and_table(capsys):
    from optimus.cli import main

    code = main(["train", "configs/mula-tiny-moe.yaml", "--dry-run", "--world-size", "8",
                 "--parallel.dp_shard=4", "--parallel.tp=2", "--parallel.ep=2", "--device-memory-gb", "16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "preset: mula-tiny-moe" in out  # the resolved config still comes first
    assert "dry run: mula-tiny-moe" in out and "vs 16 GiB device" in out


def _saved_activation_bytes(model, ids, dtype: str) -> int:
    """Bytes of the distinct tensors autograd saves in one forward (parameters excluded)."""
    import torch

    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            model(ids, ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for ptr, size in saved.items() if ptr not in params)


@pytest.mark.parametrize("weights", ["fp32", "bf16-fsdp", "fp32-autocast"])
@pytest.mark.parametrize("norm_placement", ["pre", "post"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_activation_estimate_is_close_to_what_autograd_saves(moe, norm_placement, weights):
    """fp32; bf16 weights as FSDP's mixed precision hands them to the forward (the residual stream is bf16); fp32
    weights under bf16 autocast, as one process trains (the stream stays fp32, each linear keeps its own cast)."""
    import torch

    from optimus.models.transformer import build_model
    from optimus.parallel.activation_memory import autocast_weight_copy_bytes

    model_cfg = dict(d_model=128, n_layers=2, n_heads=4, vocab_size=2048, qk_norm=True, norm_placement=norm_placement)
    model_cfg.update(n_experts=8, top_k=2, expert_ffn_hidden=128) if moe else model_cfg.update(n_experts=0, ffn_hidden=512)
    dtype, fsdp = ("fp32" if weights == "fp32" else "bf16"), weights == "bf16-fsdp"
    config = build_config({"model": model_cfg, "train": dict(seq_len=128, micro_batch_size=2,
                                                               global_batch_size=4 if fsdp else 2, dtype=dtype)})
    dims = ParallelDims(dp_shard=2, world_size=2) if fsdp else ParallelDims(world_size=1)
    model = build_model(config.model, seed=0)
    if fsdp:
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, 2048, (2, 128), generator=torch.Generator().manual_seed(0))
    measured = _saved_activation_bytes(model, ids, dtype)
    estimate = activation_bytes(config, dims, layers=2, has_loss_head=True, loss_on_cpu=True)
    estimate += autocast_weight_copy_bytes(config, dims, 2, True, loss_on_cpu=True)  # saved too, as weights' casts
    # the CPU loss kernel saves its input and weight gradients; its chunk buffers and bf16 partial products, its
    # input and the casts it makes are transients, not saved tensors (test_loss_head_bytes_match_what_the_cpu_loss_
    # allocates counts those)
    tokens, vocab, d_model = 256, 2048, 128
    width, stream = (2 if dtype == "bf16" else 4), stream_width(config, dims)
    estimate -= min(512, tokens) * vocab * width + (6 * vocab * d_model if dtype == "bf16" else 0)
    estimate -= tokens * d_model * (stream + (width if stream != width else 0)) + (
        2 * vocab * d_model if stream != width else 0)
    assert estimate == pytest.approx(measured, rel=0.05)


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


def _torch_interleaved_peak(pp: int, virtual: int, n_micro: int, rank: int) -> float:
    """The most chunk forwards torch's ScheduleInterleaved1F1B keeps un-backwarded on `rank`, over `virtual`."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)  # its order only: no stages, no group
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, virtual, n_micro
    schedule.number_of_rounds = max(1, n_micro // pp)
    schedule.microbatches_per_round = n_micro // schedule.number_of_rounds
    live = most = 0
    for action in schedule._calculate_single_rank_operations(rank):
        if action is not None and action.computation_type == _ComputationType.FORWARD:
            live += 1
        elif action is not None and action.computation_type in (_ComputationType.FULL_BACKWARD,
                                                                 _ComputationType.BACKWARD_INPUT):
            live -= 1
        most = max(most, live)
    return most / virtual


@pytest.mark.parametrize("pp,virtual,n_micro", [(2, 2, 4), (4, 2, 8), (4, 2, 12), (4, 4, 16), (8, 2, 8), (32, 2, 64)])
def test_interleaved_in_flight_follows_torchs_schedule(pp, virtual, n_micro):
    from optimus.parallel.activation_memory import micro_batches_in_flight

    config = build_config({"model": {"preset": "mula-tiny-dense", "n_layers": pp * virtual},
                           "parallel": dict(pp=pp, pp_schedule="interleaved_1f1b", pp_virtual_stages=virtual),
                           "train": {"global_batch_size": n_micro, "micro_batch_size": 1, "seq_len": 32}})
    dims = ParallelDims.from_config(config.parallel, pp)
    for stage in range(pp):
        assert micro_batches_in_flight(config, dims, stage) == _torch_interleaved_peak(pp, virtual, n_micro, stage)


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
    assert fsdp_root_reduce_bytes(10.0, ParallelDims(world_size=2, tp=2)) == 0.0  # no FSDP


@pytest.mark.parametrize("preset", ["mula-tiny-dense", "mula-tiny-moe"])
def test_autocast_weight_copies_are_the_bf16_casts_autograd_keeps(preset):
    """One process in bf16: every block's matrices are cast to bf16 by autocast (the experts by their fused op) and
    kept for the backward; the saved tensors of a real forward, deduplicated by storage, against the formula."""
    import torch

    from optimus.models.transformer import build_model
    from optimus.parallel.activation_memory import autocast_weight_copy_bytes

    config = build_config({"model": {"preset": preset}, "train": {"seq_len": 32, "micro_batch_size": 2,
                                                                   "global_batch_size": 2, "dtype": "bf16"}})
    model = build_model(config.model, seed=0)
    shapes = {tuple(p.shape) for p in model.layers.parameters() if p.dim() >= 2}
    kept: dict[int, int] = {}

    def pack(tensor):
        if tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in shapes:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    ids = torch.randint(0, config.model.vocab_size, (2, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, ids)
    layers = config.model.n_layers
    expected = autocast_weight_copy_bytes(config, ParallelDims(world_size=1), layers, has_loss_head=False)
    assert sum(kept.values()) == pytest.approx(expected, rel=0.02)


def test_autocast_weight_copies_only_where_fp32_weights_compute_in_bf16():
    from optimus.parallel.activation_memory import autocast_weight_copy_bytes

    def copies(dims, shard_mode="fsdp", **train):
        config = build_config({"model": {"preset": "mula-tiny-dense"}, "parallel": {"shard_mode": shard_mode},
                               "train": {"seq_len": 32, "global_batch_size": 8, "dtype": "bf16", **train}})
        return autocast_weight_copy_bytes(config, dims, 4, has_loss_head=False)

    one, two = ParallelDims(world_size=1), ParallelDims(dp_shard=2, world_size=2)
    blocks = copies(one)
    assert blocks > 0 and copies(two) == 0 and copies(two, "zero1") == 0  # FSDP gathers bf16, zero keeps bf16
    assert copies(two, "ddp") == blocks  # whole fp32 replicas
    assert copies(one, compile=True) == 0 and copies(one, dtype="fp32") == 0
    assert copies(one, activation_checkpointing="full") == pytest.approx(blocks / 4)  # the block recomputed
