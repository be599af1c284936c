"""Each rank computes its own shards of the initial weights (no broadcast, no full model anywhere);
gathered, they are exactly the single-process model's weights, whatever the layout: uneven FSDP
shards (vocab 130 over 4 ranks), experts sharded on dim 1 (one expert per EP rank over two FSDP
ranks), tensor parallel with FSDP, and pipeline stages."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from optimus.parallel.mesh import ParallelDims
from optimus.parallel.parallelize import build_parallel_model, single_process_name
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import tiny_config

pytestmark = pytest.mark.distributed


def _gathered_weights(rank: int, world: int, config) -> dict[str, torch.Tensor]:
    p = config.parallel
    dims = ParallelDims.from_config(p, world)
    model = build_parallel_model(config, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    weights = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        weights[single_process_name(name)] = full.clone()
    return weights


LAYOUTS = {
    "dp_shard4-uneven-vocab-experts-dim1": (
        dict(moe=True, parallel=dict(dp_shard=4, ep=2), model=dict(vocab_size=130, n_experts=2, top_k=2)),
    ),
    "tp2-dp_shard2": (dict(moe=True, parallel=dict(tp=2, dp_shard=2)),),
    "pp2-dp_shard2": (dict(moe=False, parallel=dict(pp=2, dp_shard=2)),),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_fills_its_shards_with_the_single_process_weights(layout):
    from optimus.models.transformer import build_model

    (kwargs,) = LAYOUTS[layout]
    config = tiny_config(**kwargs)
    want = build_model(config.model, seed=config.train.seed).state_dict()
    seen = set()
    for weights in run_distributed(_gathered_weights, 4, config):
        for name, tensor in weights.items():
            assert torch.equal(tensor, want[name]), name
            seen.add(name)
    assert seen == set(want)  # every parameter is held by some rank (pipeline stages split them)
