"""The sequence-parallel norms' gradient all-reduces one micro-batch's backward runs, counted, against what the
planner prices (optimus/plan/block_collectives.norm_gradient_reduces).

Their weights are replicated over tp but see only their rank's tokens, so the backward leaves their gradients as
Partial sums. FSDP's post-backward redistributes each one to its parameter's placement (an all-reduce a weight, in
every micro-batch); zero1 keeps them Partial until the step sums them all at once (train/step.py).
"""

from __future__ import annotations

import pytest

from tests.helpers.dispatch import OpCounter
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import parallel_model_and_first_batch, tiny_config

pytestmark = pytest.mark.distributed

FUNCTIONAL_ALL_REDUCE = "_c10d_functional.all_reduce.default"  # DTensor's redistribution of a Partial gradient


def _backward_all_reduces(rank: int, world: int, moe: bool, shard_modes: list[str]) -> dict[str, int]:
    counts = {}
    for mode in shard_modes:
        config = tiny_config(moe=moe, parallel=dict(dp_shard=2, tp=2, shard_mode=mode))
        model, (ids, labels) = parallel_model_and_first_batch(config, world)
        loss = model(ids, labels=labels).loss
        with OpCounter() as backward:
            loss.backward()
        counts[mode] = backward.calls[FUNCTIONAL_ALL_REDUCE]
    return counts


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fsdp_reduces_each_norm_gradient_over_tp_in_the_backward(moe):
    from optimus.parallel.mesh import ParallelDims
    from optimus.plan.block_collectives import norm_gradient_reduces

    counts = run_distributed(_backward_all_reduces, 4, moe, ["fsdp", "zero1"])[0]
    priced = {}
    for mode in counts:
        config = tiny_config(moe=moe, parallel=dict(dp_shard=2, tp=2, shard_mode=mode))
        priced[mode] = norm_gradient_reduces(config, ParallelDims.from_config(config.parallel, 4),
                                             config.model.n_layers)
    assert priced["zero1"] == 0 and priced["fsdp"] == 2 * 2 + 1
    # what the backward redistributes beyond zero1's (the same model and layout, its norms' gradients left Partial)
    assert counts["fsdp"] - counts["zero1"] == priced["fsdp"]
