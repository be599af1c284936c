"""zero1 / zero2 (optim/sharded.py) against one process: losses and step-1 gradients within the parity
tolerances (optimus.testing.parity: fp32 loss rel 1e-5 at step 1, 1e-4 later; grads atol 1e-5 / rtol 1e-4),
EP-aware and EP-unaware; the per-rank optimizer-state sizes the EP-aware scheme promises; resume."""

from __future__ import annotations

import pytest

from optimus.testing.parity import check_layout, tiny_config

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("mode", ["zero1", "zero2"])
def test_dense_dp_shard_2_matches_one_process(mode):
    check_layout(tiny_config(parallel=dict(dp_shard=2, shard_mode=mode)), world_size=2, steps=3)


@pytest.mark.parametrize("mode,ep_aware", [("zero1", True), ("zero2", True), ("zero1", False), ("zero2", False)])
def test_moe_dp_2_ep_2_matches_one_process(mode, ep_aware):
    config = tiny_config(moe=True, parallel=dict(dp_shard=4, ep=2, shard_mode=mode, ep_aware=ep_aware))
    check_layout(config, world_size=4, steps=3)
