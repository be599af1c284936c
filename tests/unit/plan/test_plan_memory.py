"""The memory model's arithmetic (optimus/plan/memory.py) on parameter counts chosen by hand: how each shard mode
splits the weights and the optimizer state, which pipeline stage holds the embedding and the head, and how the
zero modes cut their buckets. test_plan_model.py holds the whole model against the dry run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from optimus.config import load_config
from optimus.parallel.mesh import ParallelDims
from optimus.parallel.validate import validate_layout
from optimus.plan.memory import ModelShape, TensorShape, _bucket_sizes, peak_stage_memory, stage_memory

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
# 4 blocks of 1,000 tensor-parallel weights, 10 replicated and 1,600 experts' each; a 5,000 embedding, a 6,000
# head (DENSE: no experts)
SHAPE = ModelShape(n_layers=4, block_tp_split=1000, block_replicated=10, block_attention=400, block_experts=1600,
                   embedding=5000, head=6000, tensors=())
DENSE = replace(SHAPE, block_experts=0)


def _layout(config: str, *overrides: str):
    layout = validate_layout(load_config(CONFIGS / config, ["--train.global_batch_size=16", *overrides]), 8)
    return layout.config, layout.dims


def test_ddp_holds_whole_fp32_weights_gradients_moments_and_buckets():
    """4 x (1,000 + 10) + 5,000 + 6,000 = 15,040 elements: 4 B each of weights, gradients and DDP's buckets, 8 B of
    AdamW moments, on every rank."""
    config, dims = _layout("mula-tiny-dense.yaml", "--parallel.dp_shard=8", "--parallel.shard_mode=ddp",
                           "--train.dtype=fp32")
    held = stage_memory(config, dims, DENSE, 0)
    assert [held[k] for k in ("parameters", "gradients", "optimizer", "DDP buckets")] == [
        4 * 15040, 4 * 15040, 8 * 15040, 4 * 15040]


def test_zero1_under_bf16_holds_whole_bf16_weights_and_its_share_of_master_and_moments():
    """Tensor parallelism 2 halves the matrices, the embedding and the head (vocabulary-parallel) but not the norms:
    4 x (500 + 10) + 2,500 + 3,000 = 7,540 elements at 2 B; the optimizer state (4 B master + 8 B moments) only for
    the 7,540 / 4 = 1,885 a data-parallel rank owns."""
    config, dims = _layout("mula-tiny-dense.yaml", "--parallel.dp_shard=4", "--parallel.tp=2",
                           "--parallel.shard_mode=zero1", "--train.dtype=bf16")
    held = stage_memory(config, dims, DENSE, 0)
    assert held["parameters"] == 2 * 7540 and held["optimizer"] == 12 * 1885
    fp32 = stage_memory(config.model_copy(update={"train": config.train.model_copy(update={"dtype": "fp32"})}), dims,
                        DENSE, 0)
    assert fp32["parameters"] == 4 * 7540 and fp32["optimizer"] == 8 * 1885  # no master copy: fp32 is the master
    auto = config.model_copy(update={"train": config.train.model_copy(update={"dtype": "auto"})})
    assert stage_memory(auto, dims, DENSE, 0)["parameters"] == 2 * 7540  # "auto" computes bf16, as the dry run


def test_zero_modes_shard_the_experts_over_the_ranks_holding_the_same_experts():
    """ep 2 x tp 2 split each block's 1,600 expert weights four ways (400 a block, 1,600 a rank); the non-expert
    4 x 510 + 2,500 + 3,000 = 7,540 are sharded over all 4 data-parallel ranks (ep_aware) or, as the ablation
    baseline, over the 2 that hold the same experts; the experts' state always over those 2."""
    config, dims = _layout("mula-tiny-moe.yaml", "--parallel.dp_shard=4", "--parallel.tp=2", "--parallel.ep=2",
                           "--parallel.shard_mode=zero1", "--train.dtype=fp32")
    held = stage_memory(config, dims, SHAPE, 0)
    assert held["parameters"] == 4 * (7540 + 1600)
    assert held["optimizer"] == 8 * (7540 / 4 + 1600 / 2)
    baseline = config.model_copy(update={"parallel": config.parallel.model_copy(update={"ep_aware": False})})
    assert stage_memory(baseline, dims, SHAPE, 0)["optimizer"] == 8 * (7540 / 2 + 1600 / 2)


def test_the_first_stage_holds_the_embedding_and_the_last_the_head():
    """pp 2: two blocks a stage (2 x 1,010 = 2,020), the embedding's 5,000 on the first, the head's 6,000 on the
    last; the peak is the fuller stage's."""
    config, dims = _layout("mula-tiny-dense.yaml", "--parallel.dp_shard=4", "--parallel.pp=2",
                           "--parallel.shard_mode=zero1", "--train.dtype=fp32")
    first, last = (stage_memory(config, dims, DENSE, stage) for stage in (0, 1))
    assert (first["parameters"], last["parameters"]) == (4 * 7020, 4 * 8020)
    peak = peak_stage_memory(config, dims, DENSE)
    assert peak in (first, last) and sum(peak.values()) == max(sum(first.values()), sum(last.values()))


def test_a_pipeline_stage_holds_its_share_of_blocks_rounded_up():
    """5 blocks over 2 stages: the fuller stage holds 3 (pipeline.rank_layers gives the first stages the extra)."""
    config, dims = _layout("mula-tiny-dense.yaml", "--parallel.dp_shard=4", "--parallel.pp=2",
                           "--parallel.shard_mode=zero1", "--train.dtype=fp32")
    five = ModelShape(5, 1000, 10, 400, 0, 5000, 6000, ())
    assert stage_memory(config, dims, five, 0)["parameters"] == 4 * (3 * 1010 + 5000)


def test_a_tensor_is_split_over_tp_and_experts_over_ep_x_tp_in_ceil_sized_pieces():
    dims = ParallelDims(dp_replicate=1, dp_shard=4, tp=2, pp=1, ep=4, world_size=8)
    assert TensorShape((64, 2048, 2048), 0, True, "block").local_shape(dims) == [8, 2048, 2048]
    assert TensorShape((1024, 256), 0, False, "block").local_shape(dims) == [512, 256]
    assert TensorShape((256, 1025), 1, False, "block").local_shape(dims) == [256, 513]
    assert TensorShape((256,), None, False, "block").local_shape(dims) == [256]


@pytest.mark.parametrize("where, stages", [("block", (True, True, True)), ("embedding", (True, False, False)),
                                           ("head", (False, False, True))])
def test_every_stage_holds_its_blocks_the_first_the_embedding_the_last_the_head(where, stages):
    tensor = TensorShape((8, 8), 0, False, where)
    assert tuple(tensor.on_stage(first, last) for first, last in ((True, False), (False, False), (False, True))) \
        == stages


def test_the_zero_buckets_put_the_two_largest_parameters_alone_and_cut_the_rest():
    """250 elements in buckets of 30: the two parameters above 30 (60, 50) alone, the third (40) with the rest:
    140 = 4 x 30 + 20."""
    assert _bucket_sizes(250, [40, 60, 50, 10], 30) == [60, 50, 30, 30, 30, 30, 20]
    assert _bucket_sizes(90, [20, 30], 30) == [30, 30, 30]  # none above a bucket; no empty tail


def test_fsdp_holds_fp32_weights_gradients_and_moments_of_its_padded_shard():
    """Each tensor cut along dim 0 into 8 ceil-sized shards: a block's [100, 10] matrix 13 rows (130), its 30-long
    norm 4; the embedding's [50, 10] 7 rows (70), the head's [60, 10] 8 (80): 4 x 134 + 150 = 686 elements, 4 B of
    weights and of gradients and 8 B of moments each."""
    tensors = (TensorShape((100, 10), 0, False, "block"), TensorShape((30,), None, False, "block"),
               TensorShape((50, 10), 0, False, "embedding"), TensorShape((60, 10), 0, False, "head"))
    shape = ModelShape(4, 1000, 30, 400, 0, 500, 600, tensors)
    config, dims = _layout("mula-tiny-dense.yaml", "--parallel.dp_shard=8", "--train.dtype=fp32")
    held = stage_memory(config, dims, shape, 0)
    assert (held["parameters"], held["gradients"], held["optimizer"]) == (4 * 686, 4 * 686, 8 * 686)


def test_the_model_total_counts_blocks_embedding_and_head():
    assert SHAPE.total == 4 * (1000 + 10 + 1600) + 5000 + 6000


@pytest.mark.parametrize("loss_on_cpu, expected", [(True, 4 * 50304 * 256 / 2), (False, 0.0)])
def test_on_cpus_the_loss_holds_its_vocabulary_slices_head_weight_gradient(monkeypatch, loss_on_cpu, expected):
    """The CPU loss kernel's fp32 gradient of the LM head weight, [V / tp, d] (tp 2 splits the vocabulary): 4 B x
    50,304 / 2 x 256 at the root's reduce; accelerators' F.cross_entropy holds none of its own."""
    import inspect

    from optimus.parallel import dry_run
    from optimus.plan import memory

    passed = []

    def peak_phase_terms(*args, **kwargs):
        bound = inspect.signature(dry_run.peak_phase_terms).bind(*args, **kwargs)
        passed.append(bound.arguments.get("loss_weight_gradient", 0.0))
        return 0.0, 0.0

    monkeypatch.setattr(memory, "peak_phase_terms", peak_phase_terms)
    config, dims = _layout("mula-tiny-dense.yaml", "--parallel.dp_shard=4", "--parallel.tp=2",
                           "--parallel.shard_mode=zero1", "--train.dtype=fp32")
    stage_memory(config, dims, DENSE, 0, loss_on_cpu=loss_on_cpu)
    assert passed == [expected]


def test_the_model_is_counted_by_how_a_layout_splits_each_weight():
    """mula-tiny-moe, d 256, 16 experts of hidden 512, vocabulary 50,304, per block: the four 256 x 256 attention
    matrices split over tp (262,144); the norms (4 x 256) and the router (16 x 256) whole on every tp rank (5,120);
    the experts' [16, 256, 1024] and [16, 512, 256] over ep x tp (6,291,456). Embedding and head 50,304 x 256, the
    head with the final norm's 256. One block's and the root's tensors, each with the dim tp cuts."""
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", [])
    shape = ModelShape.of(config)
    assert (shape.n_layers, shape.block_tp_split, shape.block_attention, shape.block_replicated,
            shape.block_experts) == (4, 262144, 262144, 5120, 6291456)
    assert (shape.embedding, shape.head) == (12877824, 12877824 + 256)
    dims = {t.shape: (t.tp_dim, t.expert, t.where) for t in shape.tensors}
    assert len(shape.tensors) == 14
    assert dims[(16, 256)] == (None, False, "block")  # the router
    assert dims[(16, 512, 256)] == (0, True, "block") and dims[(50304, 256)][0] == 0
    assert sorted(t.tp_dim for t in shape.tensors if t.shape == (256, 256)) == [0, 0, 0, 1]  # o_proj by rows


@pytest.mark.parametrize("ep_aware, dense_ranks", [(True, 4), (False, 2)])
def test_the_zero_buffers_cut_the_non_expert_bucket_over_the_ranks_that_own_its_state(monkeypatch, ep_aware,
                                                                                      dense_ranks):
    """The bucket buffers are sized by the segments each rank reduces: the 7,540 non-expert elements over the 4
    data-parallel ranks (ep_aware) or the 2 holding the same experts; the 1,600 experts' over those 2."""
    from optimus.optim import buffers
    from optimus.plan import memory

    layouts = []
    monkeypatch.setattr(buffers, "buffer_nbytes", lambda layout, *rest: layouts.append(layout) or [0.0])
    memory._zero_buffers.cache_clear()
    config, dims = _layout("mula-tiny-moe.yaml", "--parallel.dp_shard=4", "--parallel.tp=2", "--parallel.ep=2",
                           "--parallel.shard_mode=zero1", "--train.dtype=fp32", f"--parallel.ep_aware={ep_aware}")
    stage_memory(config, dims, SHAPE, 0)
    memory._zero_buffers.cache_clear()
    assert layouts == [[(dense_ranks, -(-7540 // dense_ranks)), (2, 800)]]


def test_the_peak_is_the_first_stages_where_the_embedding_outweighs_the_head():
    """pp 2 with a 100M-element embedding and a 6,000 head: the first stage holds 2 x 1,010 + 100,000,000 fp32
    parameters (with their gradients and moments, far more than the last stage's head and logits), so the peak is
    the first stage's: 4 x 100,002,020 B of parameters."""
    config, dims = _layout("mula-tiny-dense.yaml", "--parallel.dp_shard=4", "--parallel.pp=2",
                           "--parallel.shard_mode=zero1", "--train.dtype=fp32")
    peak = peak_stage_memory(config, dims, replace(DENSE, embedding=100_000_000))
    assert peak["parameters"] == 4 * 100_002_020
