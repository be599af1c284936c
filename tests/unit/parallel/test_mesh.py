"""ParallelDims: layouts the model or the sequence length cannot take are refused in one line (check_model); the
mesh's flattened groups span the ranks they are named for (build_mesh); expert_dp and has_data_parallel by hand."""

from __future__ import annotations

import pytest

from optimus.models.config import ModelConfig
from optimus.parallel.mesh import LayoutError, ParallelDims

MODEL = ModelConfig(d_model=64, n_layers=4, n_heads=4, vocab_size=256, n_experts=8, top_k=2, expert_ffn_hidden=32)


def test_sequence_length_must_divide_over_tensor_parallel_ranks():
    dims = ParallelDims(tp=2, world_size=2)
    dims.check_model(MODEL, seq_len=64)
    dims.check_model(MODEL)  # no sequence length given: not checked
    with pytest.raises(LayoutError, match=r"train.seq_len \(33\) must be a multiple of parallel.tp \(2\)") as err:
        dims.check_model(MODEL, seq_len=33)
    assert "\n" not in str(err.value)
    ParallelDims(dp_shard=2, world_size=2).check_model(MODEL, seq_len=33)  # no tp: any length


def test_heads_and_experts_must_divide():
    with pytest.raises(LayoutError, match="n_heads"):
        ParallelDims(tp=8, world_size=8).check_model(MODEL)
    with pytest.raises(LayoutError, match="n_experts"):
        ParallelDims(dp_shard=3, ep=3, world_size=3).check_model(MODEL)


def _group_sizes(parallel: dict, world: int, rank: int) -> dict[str, int]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from optimus.parallel.mesh import ParallelDims

    dims = ParallelDims(world_size=world, **parallel)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = dims.build_mesh("cpu")
        return {name: mesh.size(name) for name in ("dp", "dp_shard", "expert_dp", "ep", "tp", "pp")}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("parallel, world, sizes", [
    # every data-parallel rank reads its own samples: dp spans the expert-parallel ranks too
    (dict(dp_shard=4, ep=2), 4, dict(dp=4, dp_shard=4, expert_dp=2, ep=2, tp=1, pp=1)),
    (dict(dp_replicate=2, dp_shard=2, ep=2, tp=2), 8, dict(dp=4, dp_shard=2, expert_dp=2, ep=2, tp=2, pp=1)),
    (dict(pp=2, dp_shard=2), 4, dict(dp=2, dp_shard=2, expert_dp=2, ep=1, tp=1, pp=2)),
])
def test_the_flattened_groups_span_the_ranks_they_are_named_for(parallel, world, sizes):
    from tests.helpers import run_forked

    for rank in (0, world - 1):
        assert run_forked(_group_sizes, parallel, world, rank) == sizes


def test_expert_data_parallelism_and_data_parallelism_by_hand():
    """Ranks holding the same experts: dp_replicate x dp_shard / ep (the ep ranks of a dp_shard group split the
    experts, so they are not replicas of each other); the batch is shared only where dp > 1 (tp or pp alone: no
    data parallelism to shard or average over)."""
    assert ParallelDims(dp_shard=4, ep=2, world_size=4).expert_dp == 2
    assert ParallelDims(dp_replicate=2, dp_shard=2, ep=2, tp=2, world_size=8).expert_dp == 2
    assert ParallelDims(dp_shard=2, world_size=2).expert_dp == 2
    assert not ParallelDims(tp=2, world_size=2).has_data_parallel
    assert not ParallelDims(pp=2, world_size=2).has_data_parallel
    assert ParallelDims(dp_replicate=2, world_size=2).has_data_parallel


def test_tensor_parallel_ranks_must_divide_the_kv_heads_too():
    gqa = ModelConfig(d_model=64, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=256)
    ParallelDims(tp=2, world_size=2).check_model(gqa)
    with pytest.raises(LayoutError, match=r"n_kv_heads \(2\): use a tp that divides 2$"):
        ParallelDims(tp=4, world_size=4).check_model(gqa)


def test_a_degree_below_1_names_the_setting():
    with pytest.raises(LayoutError, match=r"^parallel.tp: Input should be greater than 0 \(got 0\)$"):
        ParallelDims(tp=0, world_size=1)
