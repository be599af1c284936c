"""validate_layout: one place for every layout and batch rule; the micro-batch derived from the global batch."""

from __future__ import annotations

import pytest

from optimus.config import ConfigError, build_config
from optimus.parallel.mesh import LayoutError
from optimus.parallel.validate import validate_layout

TINY = {"d_model": 64, "n_layers": 4, "n_heads": 4, "n_experts": 8, "top_k": 2, "expert_ffn_hidden": 32,
        "vocab_size": 256}


def _config(parallel=None, train=None, model=None):
    return build_config({"model": {**TINY, **(model or {})}, "parallel": parallel or {},
                         "train": {"seq_len": 64, **(train or {})}})


@pytest.mark.parametrize("parallel, global_batch, micro, n_micro", [
    ({}, 8, 8, 1),                                  # one rank: the whole batch in one micro-batch
    ({"dp_shard": 2}, 8, 4, 1),                     # the README's two-rank example
    ({"dp_shard": 2, "ep": 2}, 16, 8, 1),
    ({"dp_replicate": 2, "shard_mode": "ddp"}, 8, 4, 1),  # pure data parallel: ddp is accepted
    ({"pp": 2}, 8, 4, 2),                           # 1F1B needs pp micro-batches
    ({"pp": 4, "dp_shard": 2}, 24, 3, 4),           # 12 per rank: 4 micro-batches of 3
    ({"pp": 2, "pp_schedule": "gpipe"}, 8, 4, 2),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}, 8, 4, 2),
])
def test_micro_batch_is_derived_from_the_global_batch(parallel, global_batch, micro, n_micro):
    layout = validate_layout(_config(parallel, {"global_batch_size": global_batch}))
    assert layout.batch.derived
    assert (layout.batch.micro_batch_size, layout.batch.micro_batches) == (micro, n_micro)
    assert layout.config.train.micro_batch_size == micro  # what the trainer and the dry run use
    assert "derived" in layout.batch.describe() and "\n" not in layout.batch.describe()


def test_an_explicit_micro_batch_is_kept():
    layout = validate_layout(_config({"dp_shard": 2}, {"global_batch_size": 8, "micro_batch_size": 2}))
    assert not layout.batch.derived and layout.batch.micro_batches == 2
    assert layout.config.train.micro_batch_size == 2


@pytest.mark.parametrize("parallel, train, model, world, needle", [
    ({"dp_shard": 2}, {}, {}, 4, "but the job has 4 ranks"),
    ({"dp_shard": 2, "ep": 3}, {}, {}, None, "parallel.ep (3) must divide parallel.dp_shard (2)"),
    ({"tp": 8}, {}, {}, None, "must divide model.n_heads"),
    ({"tp": 2}, {"seq_len": 33}, {}, None, "train.seq_len (33) must be a multiple of parallel.tp (2)"),
    ({"dp_shard": 3, "ep": 3}, {"global_batch_size": 9}, {}, None, "must divide model.n_experts"),
    ({"dp_shard": 2, "ep": 2, "tp": 4}, {}, {"n_experts": 4, "n_heads": 4}, None,
     "parallel.ep x tp (2 x 4) must divide model.n_experts (4)"),
    ({"dp_shard": 2, "ep": 2}, {}, {"n_experts": 0, "ffn_hidden": 64}, None, "needs an MoE model"),
    ({"pp": 8}, {"global_batch_size": 8}, {}, None, "fewer than the pipeline stages"),
    ({"pp": 2}, {"micro_batch_size": 8}, {}, None, "needs at least pp (2) micro-batches per step, got 1"),
    ({"pp": 4}, {"global_batch_size": 2}, {}, None, "raise train.global_batch_size to a multiple of 4"),
    ({"pp": 2, "pp_virtual_stages": 2}, {}, {}, None, "needs parallel.pp_schedule=interleaved_1f1b"),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b"}, {}, {}, None, "pp_virtual_stages >= 2"),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}, {"global_batch_size": 5, "micro_batch_size": 1},
     {}, None, "cannot split 5 micro-batches"),
    ({"dp_shard": 3}, {}, {"n_experts": 0, "ffn_hidden": 64}, None, "not divisible by the 3 data-parallel ranks"),
    # every data-parallel rank counts, the replicas' too (dp_replicate x dp_shard), and every virtual stage
    ({"dp_replicate": 2, "dp_shard": 2}, {"global_batch_size": 6}, {"n_experts": 0, "ffn_hidden": 64}, None,
     "not divisible by the 4 data-parallel ranks"),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 4}, {"global_batch_size": 8},
     {"n_layers": 4}, None, "fewer than the pipeline stages (pp x virtual stages = 8)"),
    ({"dp_shard": 2}, {"micro_batch_size": 8}, {}, None, "gets 4 samples"),
    ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, {"activation_checkpointing": "selective_ops"}, {}, None,
     "activation_checkpointing=selective_ops"),
    ({"pp": 2}, {"eval_tasks": ["arc_easy"]}, {}, None, "train.eval_tasks is not supported with parallel.pp > 1"),
    ({"dp_shard": 2, "tp": 2, "shard_mode": "ddp"}, {}, {}, None, "shard_mode=ddp is for pure data parallelism"),
    ({"dp_shard": 2, "ep": 2, "shard_mode": "ddp"}, {}, {}, None, "does not compose with parallel.ep=2"),
])
def test_every_rule_refuses_in_one_line(parallel, train, model, world, needle):
    raw = {"model": {**TINY, **model}, "parallel": parallel, "train": {"seq_len": 64, **train}}
    if world is None:  # the degrees imply the world size: the config itself refuses at load
        with pytest.raises(ConfigError) as err:
            build_config(raw)
    else:
        with pytest.raises(LayoutError) as err:
            validate_layout(build_config(raw), world)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_micro_batch_counts_tried_are_every_divisor_in_order():
    from optimus.parallel.validate import divisors as _divisors

    for n in [*range(1, 400), 2**12, 3 * 5 * 7 * 11 * 13]:
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    assert _divisors(99_999_989) == [1, 99_999_989]  # a prime share of 10^8 samples: 10^4 trial divisions
    assert _divisors(10**8)[-3:] == [25_000_000, 50_000_000, 100_000_000]


def test_the_interleaved_schedule_takes_micro_batches_in_whole_rounds_of_about_pp():
    """torch's interleaved 1F1B runs max(1, n // pp) rounds and needs n to divide into them."""
    from optimus.parallel.validate import check_pipeline_micro_batches

    for n_micro in (3, 4, 6, 10, 12):  # pp 2: 3 is one round of 3; pp 4: 6 one round, 10 two of 5
        check_pipeline_micro_batches("interleaved_1f1b", 4 if n_micro in (6, 10) else 2, n_micro)
    with pytest.raises(LayoutError, match=r"cannot split 9 micro-batches per step into rounds of pp \(4\)"):
        check_pipeline_micro_batches("interleaved_1f1b", 4, 9)


def test_selective_ops_is_refused_only_where_the_experts_fsdp_group_is_one_rank_under_hsdp():
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.validate import check_checkpointing_layout

    check_checkpointing_layout("selective_ops", ParallelDims(dp_shard=2, ep=2, world_size=2))
    check_checkpointing_layout("selective_ops", ParallelDims(dp_replicate=2, dp_shard=4, ep=2, world_size=8))
    with pytest.raises(LayoutError, match="selective_ops does not work with parallel.ep = dp_shard"):
        check_checkpointing_layout("selective_ops", ParallelDims(dp_replicate=2, dp_shard=2, ep=2, world_size=4))


def test_virtual_stages_do_not_count_without_a_pipeline():
    layout = validate_layout(_config({"pp_virtual_stages": 2}, {"global_batch_size": 8}, {"n_layers": 1}))
    assert layout.dims.pp == 1
