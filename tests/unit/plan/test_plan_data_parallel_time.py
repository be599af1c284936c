"""Data parallelism's share of a step (optimus/plan/data_parallel_time.py): where each shard mode's collectives fall
(per micro-batch beside compute, in the last backward, after it), its buffers, and the helpers that count them."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.config import load_config
from optimus.parallel.validate import validate_layout
from optimus.plan.cluster import Cluster
from optimus.plan.data_parallel_time import DataParallelTime, data_parallel_time
from optimus.plan.memory import ModelShape
from tests.helpers.plan import toy_cluster

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
HBM = 1e12  # bytes a second of memory-bound work: any, the tests compare layouts on the same one


def _toy() -> Cluster:
    return toy_cluster(devices_per_node=4)


def _time(overrides: list[str], hidden_by_backward: float = 0.0, preset: str = "mula-tiny-dense") -> DataParallelTime:
    """The tiny model's data-parallel time at a layout (bf16, micro-batch 2, global batch 8 unless overridden)."""
    config = load_config(CONFIGS / f"{preset}.yaml", ["--train.dtype=bf16", "--train.micro_batch_size=2",
                                                      "--train.global_batch_size=8", *overrides])
    layout = validate_layout(config, config.parallel.layout_ranks)
    shape, dims = ModelShape.of(layout.config), layout.dims
    layers = -(-shape.n_layers // dims.pp)
    return data_parallel_time(layout.config, dims, shape, _toy(), layers, layout.batch.micro_batches,
                              hidden_by_backward, HBM, HBM)


def test_fsdp_under_defer_all_reduce_scatters_once_in_the_last_backward():
    """Two micro-batches at FSDP 2: by default each reduce-scatters beside its own compute; under
    defer_grad_sync=all the same reduce-scatter runs once, in the last backward, and its copies once a step."""
    each = _time(["--parallel.dp_shard=2"])
    once = _time(["--parallel.dp_shard=2", "--parallel.defer_grad_sync=all"])
    assert each.last_backward == 0.0 and once.last_backward > 0.0
    assert each.overlappable_mb - once.overlappable_mb == pytest.approx(once.last_backward)
    assert once.copies_step > 0.0 == each.copies_step and once.copies_mb < each.copies_mb
    assert once.step_sync == each.step_sync == 0.0 and once.owned == each.owned
    # one micro-batch: nothing to defer
    single = ["--parallel.dp_shard=2", "--train.global_batch_size=4"]
    assert _time([*single, "--parallel.defer_grad_sync=all"]) == _time(single)


def test_hsdp_all_reduces_each_unit_in_the_last_backward_or_every_one_under_none():
    replicate = _time(["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.global_batch_size=16"])
    none = _time(["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.global_batch_size=16",
                  "--parallel.defer_grad_sync=none"])
    plain = _time(["--parallel.dp_shard=2", "--train.global_batch_size=16", "--parallel.dp_replicate=1"])
    assert replicate.last_backward > 0.0 == none.last_backward
    assert none.overlappable_mb - replicate.overlappable_mb == pytest.approx(replicate.last_backward)
    assert replicate.overlappable_mb == pytest.approx(plain.overlappable_mb)  # the shard group is the same


def test_fsdp_under_pp_reduces_once_after_the_last_backward():
    piped = _time(["--parallel.dp_shard=2", "--parallel.pp=2"])
    assert piped.step_sync > 0.0 and piped.last_backward == 0.0 and piped.copies_step > 0.0


def test_ddp_all_reduces_every_micro_batch_under_none_and_its_backward_hides_it():
    once = _time(["--parallel.dp_shard=2", "--parallel.shard_mode=ddp"])
    each = _time(["--parallel.dp_shard=2", "--parallel.shard_mode=ddp", "--parallel.defer_grad_sync=none"])
    assert once.step_sync > 0.0 and each.step_sync == pytest.approx(2 * once.step_sync)
    assert _time(["--parallel.dp_shard=2", "--parallel.shard_mode=ddp"], hidden_by_backward=1.0).step_sync == 0.0
    assert once.overlappable_mb == once.last_backward == once.copies_mb == 0.0
    # bf16 reduction: the comm hook's casts, once a sync
    cast = _time(["--parallel.dp_shard=2", "--parallel.shard_mode=ddp", "--parallel.grad_reduce_dtype=bf16"])
    assert cast.copies_step == pytest.approx(12 * cast.owned / HBM) and once.copies_step == 0.0


def test_zero2_reduces_in_each_backward_what_zero1_reduces_after_the_last():
    zero1 = _time(["--parallel.dp_shard=2", "--parallel.shard_mode=zero1", "--train.global_batch_size=4"])
    zero2 = _time(["--parallel.dp_shard=2", "--parallel.shard_mode=zero2", "--train.global_batch_size=4"])
    assert zero2.exposed_mb > 0.0 and zero1.exposed_mb == 0.0
    assert zero1.step_sync == pytest.approx(zero2.step_sync + zero2.exposed_mb)  # one micro-batch: the same bytes
    hidden = _time(["--parallel.dp_shard=2", "--parallel.shard_mode=zero2", "--train.global_batch_size=4"],
                   hidden_by_backward=1.0)
    assert hidden.exposed_mb == 0.0


def test_zero_buffers_move_what_optim_sharded_moves():
    """On one data-parallel rank (tp 2) nothing travels: zero2's later micro-batches pack into the buffer and add it
    to the fp32 shard (12 B an element, an in-place sum), and fp32 parameters, their own masters, need no copy after
    the update; bf16 ones are written from the masters. Over two ranks a later reduction adds its landed output
    into the shard."""
    from optimus.plan.data_parallel_time import _zero_copy_bytes, _zero_sum_bytes

    assert _zero_copy_bytes(10.0, 1, 4, 4) == (80.0, 80.0, 0.0) and _zero_sum_bytes(10.0, 1, 4) == 120.0
    assert _zero_copy_bytes(10.0, 1, 2, 4) == (60.0, 60.0, 60.0)
    first, later, gather = _zero_copy_bytes(10.0, 2, 4, 4)
    assert (first, later) == (80.0, 80.0) and gather == 80.0 + 40.0 and _zero_sum_bytes(10.0, 2, 4) == 60.0
    assert _zero_copy_bytes(10.0, 2, 4, 2)[0] == 60.0 + 30.0  # bf16 reduced: the landed shard copied into fp32
    assert _zero_sum_bytes(10.0, 2, 2) == 50.0  # and a later one added to it
    fp32 = ["--train.dtype=fp32", "--parallel.tp=2", "--parallel.shard_mode=zero2"]
    one, four = (_time([*fp32, f"--train.global_batch_size={n}"]) for n in (2, 8))  # 1 and 4 micro-batches of 2
    assert one.copies_step == 0.0 and four.copies_mb > one.copies_mb
    # the later micro-batches' sums at the sum rate, their packing at the copy rate
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.micro_batch_size=2", *fp32])
    layout = validate_layout(config, config.parallel.layout_ranks)
    shape, dims = ModelShape.of(layout.config), layout.dims
    slow, fast = (data_parallel_time(layout.config, dims, shape, _toy(), shape.n_layers, 4, 0.0, HBM, rate)
                  for rate in (HBM, 2 * HBM))
    elements = shape.n_layers * (shape.block_tp_split / 2 + shape.block_replicated) + \
        (shape.embedding + shape.head) / 2
    assert slow.copies_mb - fast.copies_mb == pytest.approx(3 / 4 * 12 * elements / (2 * HBM), rel=1e-6)


def test_each_mode_updates_its_share_of_the_parameters():
    """A dense model on 2 ranks: FSDP and the zero modes update half of what DDP updates (the whole model)."""
    whole = _time(["--parallel.dp_shard=2", "--parallel.shard_mode=ddp"]).owned
    for mode in ("fsdp", "zero1", "zero2"):
        assert _time(["--parallel.dp_shard=2", f"--parallel.shard_mode={mode}"]).owned == pytest.approx(whole / 2)


def test_fsdp_buffers_of_fresh_pages_are_the_root_gather_and_reduce_past_the_threshold():
    """Tiny dense model (vocabulary 50,304 x d 256: the embedding and head are 49 MiB each in fp32) at FSDP 2: per
    step the root's all-gather output and the two weights copied out of it, and its reduce-scatter's input and
    output, are past glibc's 32 MiB; no block buffer is."""
    from optimus.plan.data_parallel_time import fsdp_fresh_bytes

    layout = validate_layout(load_config(CONFIGS / "mula-tiny-dense.yaml", ["--parallel.dp_shard=2",
                                                                            "--train.dtype=fp32"]), 2)
    shape = ModelShape.of(layout.config)
    model = layout.config.model
    weight = 4 * model.vocab_size * model.d_model
    root = 4 * (shape.embedding + shape.head)  # embedding, head and final norm: no padding at an even vocabulary
    per_micro_batch = ((2 * shape.n_layers - 1) / shape.n_layers, 1.0)  # block and root gathers, no pp
    gathers, reduces = fsdp_fresh_bytes(shape, layout.dims, 4, 32 * 2**20, shape.n_layers, per_micro_batch)
    assert weight >= 32 * 2**20
    assert gathers == root + 2 * weight and reduces == root + root / 2
    assert fsdp_fresh_bytes(shape, layout.dims, 4, 2**40, shape.n_layers, per_micro_batch) == (0.0, 0.0)


def test_ddp_all_reduces_in_torchs_buckets():
    from optimus.plan.data_parallel_time import ddp_bucket_bytes

    mib = 2 ** 20
    assert ddp_bucket_bytes(0.5 * mib) == [0.5 * mib]
    buckets = ddp_bucket_bytes(100 * mib)  # a 1 MiB first bucket, then 25 MiB ones, the last short
    assert buckets[0] == mib and buckets[1:4] == [25 * mib] * 3 and buckets[4] == pytest.approx(24 * mib)
    assert sum(buckets) == pytest.approx(100 * mib)


@pytest.mark.parametrize("layers, micro_batches, virtual, counted", [(2, 2, 1, 4), (2, 4, 1, 6), (3, 2, 1, 7),
                                                                     (3, 4, 1, 11), (4, 2, 2, 8)])
def test_fsdp_under_pp_gathers_as_often_as_a_profiled_step_did(layers, micro_batches, virtual, counted):
    """The block all-gathers counted in profiled MoE PP 2 + EP 2 steps (gloo all-gathers of a block unit's size,
    last stage): torch's schedules keep a unit gathered from its first backward to the step's end."""
    from optimus.plan.data_parallel_time import fsdp_gathers_per_micro_batch

    block, root = fsdp_gathers_per_micro_batch(layers, micro_batches, pp=2, virtual=virtual)
    assert block * layers * micro_batches == pytest.approx(counted)
    assert root * micro_batches == pytest.approx(1.0)  # the root once a step
    # without pp: forward and backward each micro-batch, the last block and the root once
    block, root = fsdp_gathers_per_micro_batch(layers, micro_batches, pp=1, virtual=1)
    assert (block * layers, root) == (2 * layers - 1, 1.0)



def test_fsdp_moves_the_experts_in_their_blocks_call_without_ep_and_in_their_own_under_ep():
    """parallelize.py gives the experts an FSDP unit of their own only under ep: on links with latency only, a
    MoE block at FSDP 4 pays one gather's or reduce-scatter's latency a call, under ep 2 also its experts' call
    over their pair."""
    import math
    from dataclasses import replace

    from optimus.plan.comms import group_link, ring_time

    latency_only = replace(_toy(), intra_node_gb_s=math.inf)

    def priced(overrides: list[str]) -> tuple[float, float, float]:
        """(FSDP's collectives per micro-batch, one call's latency over dp_shard, over the experts' group)"""
        config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.dtype=bf16", "--train.micro_batch_size=2",
                                                              "--train.global_batch_size=8", *overrides])
        layout = validate_layout(config, config.parallel.layout_ranks)
        shape, dims = ModelShape.of(layout.config), layout.dims
        seconds = data_parallel_time(layout.config, dims, shape, latency_only, shape.n_layers, 1, 0.0, HBM, HBM)
        whole, experts = (ring_time(group_link(dims, group, latency_only), 1.0)
                          for group in (("dp_shard_mod_ep", "ep"), ("dp_shard_mod_ep",)))
        return seconds.overlappable_mb, whole, experts

    layers = ModelShape.of(load_config(CONFIGS / "mula-tiny-moe.yaml", [])).n_layers
    block_calls = (2 * layers - 1) + layers  # gathers (the last block stays gathered for its backward), reduces
    seconds, whole, _ = priced(["--parallel.dp_shard=4"])
    assert seconds == pytest.approx((block_calls + 2) * whole)  # and the root's gather and reduce
    seconds, whole, experts = priced(["--parallel.dp_shard=4", "--parallel.ep=2"])
    assert 0.0 < experts < whole
    assert seconds == pytest.approx((block_calls + 2) * whole + block_calls * experts)


def test_a_deferred_reduce_scatter_copies_in_gradients_accumulated_in_the_reduce_dtype():
    """Deferring the reduce-scatter (defer_grad_sync=all, or under pp), FSDP accumulates whole gradients in its
    reduce dtype (fp32 here) over the micro-batches: the reduce-scatter's copy-in reads 4 bytes an element and writes
    4 (not the 2 of bf16 gradients that a reduce every micro-batch reads), once a step, over every parameter of the
    stage (the tiny dense model's, whole at dp_shard 2 without tp)."""
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=bf16"])
    shape = ModelShape.of(config)
    stage = shape.n_layers * (shape.block_tp_split + shape.block_replicated) + shape.embedding + shape.head
    once = _time(["--parallel.dp_shard=2", "--parallel.defer_grad_sync=all"])
    assert once.copies_step == pytest.approx((4 + 4) * stage / HBM, rel=1e-9)


def test_without_ep_the_experts_fresh_pages_count_with_their_blocks_buffer():
    """fsdp_fresh_bytes: without ep a block's experts travel in its own all-gather and reduce-scatter, so the
    block's buffer (2 x 64 x 64 dense rows + 4 x 64 x 64 expert rows = 20,480 fp32 elements, 81,920 B) reaches a
    81,920 B threshold although neither part would alone; each of 2 blocks gathers 1.5 times a micro-batch and
    reduces once (its 40,960 B output shard stays under the threshold); no weight copied out is that large."""
    from optimus.parallel.mesh import ParallelDims
    from optimus.plan.data_parallel_time import fsdp_fresh_bytes
    from optimus.plan.memory import TensorShape

    block = (TensorShape((64, 64), 0, False, "block"), TensorShape((4, 64, 64), 0, True, "block"))
    shape = ModelShape(n_layers=2, block_tp_split=4096, block_replicated=0, block_attention=0, block_experts=16384,
                       embedding=0, head=0, tensors=block)
    gathers, reduces = fsdp_fresh_bytes(shape, ParallelDims(dp_shard=2, world_size=2), 4, 81920, 2, (1.5, 1.0))
    assert (gathers, reduces) == (2 * 1.5 * 81920, 2 * 81920)


def test_under_pp_a_stage_holds_the_larger_of_the_embedding_and_the_head():
    """_Stage under pp: the root a rank holds is the larger of the first stage's embedding and the last's head; with
    a 60,000 embedding and a 6,000 head, zero1 at pp 2 over 2 data-parallel ranks updates half of 2 blocks x 1,010
    + 60,000 = 62,020 elements: 31,010."""
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=bf16", "--train.micro_batch_size=2",
                                                             "--train.global_batch_size=8", "--parallel.pp=2",
                                                             "--parallel.dp_shard=2", "--parallel.shard_mode=zero1"])
    layout = validate_layout(config, 4)
    shape = ModelShape(n_layers=4, block_tp_split=1000, block_replicated=10, block_attention=400, block_experts=0,
                       embedding=60000, head=6000, tensors=())
    assert data_parallel_time(layout.config, layout.dims, shape, _toy(), 2, 1, 0.0, HBM, HBM).owned == 31010


def test_hsdp_all_reduces_each_units_reduced_shard_not_the_whole_unit():
    """HSDP 2 x 2: each unit's gradients, reduce-scattered over its dp_shard pair, are all-reduced over
    dp_replicate as a shard: half the unit's fp32 bytes. On a latency-free 100 GB/s link an all-reduce of B bytes
    over a pair takes 2 x 1/2 x B / beta, so the last backward's all-reduces take 4 x (blocks + root) / 2 / 100 GB/s."""
    from dataclasses import replace

    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=bf16", "--train.micro_batch_size=2",
                                                             "--train.global_batch_size=16",
                                                             "--parallel.dp_replicate=2", "--parallel.dp_shard=2",
                                                             "--parallel.grad_reduce_dtype=fp32"])
    layout = validate_layout(config, 4)
    shape, dims = ModelShape.of(layout.config), layout.dims
    cluster = replace(_toy(), intra_node_latency_us=0.0)
    hsdp = data_parallel_time(layout.config, dims, shape, cluster, shape.n_layers, layout.batch.micro_batches, 0.0,
                              HBM, HBM)
    elements = shape.n_layers * (shape.block_tp_split + shape.block_replicated) + shape.embedding + shape.head
    assert hsdp.last_backward == pytest.approx(4 * elements / 2 / 100e9, rel=1e-9)


def test_the_ep_aware_zero_modes_sum_no_shard_over_ep():
    """zero1 at dp_shard 2 = ep 2, EP-aware: the non-expert gradients are reduce-scattered and the parameters
    gathered over all of dp (a pair), one call each per 40M-element bucket, and nothing more; the experts' group
    (expert_dp) is one rank. On latency-only links (5 us a hop) that is 2 x buckets x 5 us after the last backward:
    no all-reduce over ep, which only the EP-unaware baseline runs."""
    import math
    from dataclasses import replace

    from optimus.optim.sharded import DEFAULT_BUCKET_NUMEL

    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.dtype=bf16", "--train.micro_batch_size=2",
                                                           "--train.global_batch_size=8", "--parallel.dp_shard=2",
                                                           "--parallel.ep=2", "--parallel.shard_mode=zero1",
                                                           "--parallel.ep_aware=true"])
    layout = validate_layout(config, 2)
    shape, dims = ModelShape.of(layout.config), layout.dims
    latency_only = replace(_toy(), intra_node_gb_s=math.inf)
    zero1 = data_parallel_time(layout.config, dims, shape, latency_only, shape.n_layers, layout.batch.micro_batches,
                               0.0, HBM, HBM)
    dense = shape.n_layers * (shape.block_tp_split + shape.block_replicated) + shape.embedding + shape.head
    assert max(shape.embedding, shape.head) <= DEFAULT_BUCKET_NUMEL  # no parameter in a bucket of its own
    assert zero1.step_sync == pytest.approx(2 * math.ceil(dense / DEFAULT_BUCKET_NUMEL) * 5e-6, rel=1e-9)


def test_a_zero2_sum_on_one_rank_adds_fp32_buffers_whatever_the_reduce_dtype():
    """_zero_sum_bytes: over several ranks a later reduction's sum reads the fp32 shard (4 B) and the landed output
    (the reduce dtype's, 2 B under bf16) and writes the shard (4 B) for each owned element; on one rank nothing is
    reduced and both addends are fp32: 12 B an element, bf16 reduction or not."""
    from optimus.plan.data_parallel_time import _zero_sum_bytes

    assert _zero_sum_bytes(1000, 1, 2) == 12 * 1000
    assert _zero_sum_bytes(1000, 2, 2) == pytest.approx((4 + 2 + 4) * 1000 / 2)
