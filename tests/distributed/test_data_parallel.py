"""FSDP2 (ZeRO-3) and HSDP layouts against one process: 5 steps of losses and the step-1 gradients.

Tolerances are those of optimus.testing.parity (fp32: loss rel 1e-5 at step 1, 1e-4 later; grads
atol 1e-5 / rtol 1e-4).
"""

from __future__ import annotations

import pytest

from optimus.testing.parity import check_layout, tiny_config

pytestmark = pytest.mark.distributed


def test_fsdp_dp_shard_4_matches_one_process():
    check_layout(tiny_config(parallel=dict(dp_shard=4)), world_size=4)


def test_hsdp_replicate_2_shard_2_matches_one_process():
    check_layout(tiny_config(parallel=dict(dp_replicate=2, dp_shard=2)), world_size=4)


def test_fsdp_moe_with_full_activation_checkpointing_matches_one_process():
    config = tiny_config(moe=True, parallel=dict(dp_shard=2), train=dict(activation_checkpointing="full"))
    check_layout(config, world_size=2)
