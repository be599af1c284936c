"""The activation formulas (optimus/parallel/activation_memory.py) against what autograd saves and what the loss
ops allocate, on small CPU models; how checkpointing modes, tp and pipeline schedules change them."""

from __future__ import annotations

import pytest

from optimus.config import build_config
from optimus.parallel.activation_memory import (activation_bytes, activation_split, loss_head_bytes,
                                               rank_activation_bytes, stream_width)
from optimus.parallel.mesh import ParallelDims
from tests.helpers.precision import cpu_auto_dtype

# Mula's published training shape (seq 4096, one sequence a micro-batch), bf16, full recompute
TRAIN = dict(seq_len=4096, micro_batch_size=1, global_batch_size=1536, dtype="bf16", activation_checkpointing="full")


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


def test_micro_batches_in_flight_keep_their_saved_tensors_but_one_recompute_working_set():
    """Under recompute only the micro-batch in its backward rebuilds a block: a first pipeline stage with 128
    micro-batches in flight holds 128 block inputs, not 128 recomputed blocks (Frontier's 1T layout read 143 GiB
    per GCD when it did; the Frontier team ran it on 64 GB GCDs). Without recompute what a rank needs once is its
    first backward's MLP gradients (the gate's and up's outputs, 2 w f per token: a stage without the loss head
    peaks there)."""
    tokens = TRAIN["seq_len"] * TRAIN["micro_batch_size"]
    for mode in ("full", "selective", "none"):
        config = build_config({"model": {"preset": "mula-1b"}, "train": {**TRAIN, "activation_checkpointing": mode}})
        dims = ParallelDims(pp=4, dp_shard=2, world_size=8)
        kept, once = activation_split(config, dims, 4, has_loss_head=False)
        assert activation_bytes(config, dims, 4, False) == kept + once
        assert rank_activation_bytes(config, dims, 4, False, in_flight=8) == 8 * kept + once
        mlp_backward = 2 * 2 * config.model.ffn_hidden * tokens  # bf16
        assert once == mlp_backward if mode == "none" else once > mlp_backward
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


# make test: the MoE model (its experts' fused op casts too); the dense one in make test-slow
@pytest.mark.parametrize("preset", [pytest.param("mula-tiny-dense", marks=pytest.mark.slow), "mula-tiny-moe"])
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


@pytest.mark.parametrize("ep, tp", [(2, 1), (1, 2), (2, 2)])
def test_a_skewed_routing_scales_the_split_experts_rows_only(ep, tp):
    """routing_imbalance: the busiest rank's token copies over its balanced share. Where ep or tp split the experts,
    every term that follows the rank's rows grows with it (kept, and a tp block's backward); where one rank holds
    every expert, and for a dense model, it changes nothing."""
    moe = build_config({"model": {"preset": "mula-7b-a1b"}, "train": {**TRAIN, "activation_checkpointing": "none"}})
    dims = ParallelDims(ep=ep, tp=tp, dp_shard=ep, world_size=ep * tp)
    balanced = activation_split(moe, dims, 16, has_loss_head=False)
    skewed = activation_split(moe, dims, 16, has_loss_head=False, routing_imbalance=1.5)
    assert skewed[0] > balanced[0] and skewed[1] >= balanced[1]
    k, h, fe = moe.model.top_k, moe.model.d_model, moe.model.expert_ffn_hidden
    rows_kept = 16 * 2 * k * (2 * h + 2 * fe) / tp * 4096  # bf16 rows in (or dispatched), gate/up, rows out
    assert skewed[0] - balanced[0] >= 0.5 * rows_kept  # at least the rows' own bytes, half again
    alone = ParallelDims(world_size=1)
    assert activation_split(moe, alone, 16, False, routing_imbalance=1.5) == activation_split(moe, alone, 16, False)
    dense = build_config({"model": {"preset": "mula-1b"}, "train": TRAIN})
    assert activation_split(dense, dims, 16, False, routing_imbalance=1.5) == activation_split(dense, dims, 16, False)
