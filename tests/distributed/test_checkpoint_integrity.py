"""2 ranks: each writes and hashes its own shard; a damaged shard found by either rank is reported to both,
which agree on the same earlier checkpoint; a write failing on one rank fails the save on both."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _save_damage_and_resume(rank: int, world: int, run_dir: str):
    import torch
    import torch.distributed as dist

    from optimus.checkpoint.integrity import read_manifest
    from optimus.checkpoint.manager import CheckpointManager

    class PerRank:  # a tensor under a rank-specific key: each rank writes its own shard file
        def __init__(self):
            self.value = torch.full((1000,), float(rank))

        def state_dict(self):
            return {f"rank{rank}": self.value, "lr": 0.5}

        def load_state_dict(self, state):
            self.value = state[f"rank{rank}"]

    from torch.distributed.checkpoint.stateful import Stateful
    Stateful.register(PerRank)
    manager = CheckpointManager(run_dir, keep_last_k=3)
    for step in (1, 2):
        manager.save(step, {"part": PerRank()}, {})
    records = read_manifest(manager.step_dir(2))
    shards = sorted(name for name in records if name.endswith(".distcp"))
    if rank == 0:  # damage rank 1's shard of step 2 (the rank that wrote it hashed it)
        path = manager.step_dir(2) / shards[-1]
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    dist.barrier()
    step, skipped = CheckpointManager(run_dir, keep_last_k=3).newest_usable()
    return shards, step, skipped


def test_damage_in_one_ranks_shard_is_seen_by_both(tmp_path):
    results = run_distributed(_save_damage_and_resume, 2, str(tmp_path))
    (shards, step0, skipped0), (_, step1, skipped1) = results
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert step0 == step1 == 1 and skipped0 == skipped1 and len(skipped0) == 1
    assert "step-2 (rank 0: file '__1_0.distcp' does not match its BLAKE2b hash" in skipped0[0]
    assert (tmp_path / "checkpoints" / "damaged-step-2").is_dir()


def _save_failing_on_rank1(rank: int, world: int, run_dir: str, asynchronous: bool):
    import torch

    from optimus.checkpoint.manager import CheckpointError, CheckpointManager
    from optimus.checkpoint.writer import CheckpointWriter

    state = {"w": {"weight": torch.ones(10)}}
    manager = CheckpointManager(run_dir)
    manager.save(1, state, {}, asynchronous=asynchronous)
    manager.finish_pending()
    if rank == 1:
        def disk_full(self, plan, planner):
            raise OSError(28, "No space left on device")

        CheckpointWriter.write_data = disk_full
    try:
        manager.save(2, state, {}, asynchronous=asynchronous)
        manager.finish_pending()
    except CheckpointError as err:
        return str(err), manager.committed_steps()
    return None, manager.committed_steps()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_write_failing_on_one_rank_fails_the_save_on_both(tmp_path, asynchronous):
    results = run_distributed(_save_failing_on_rank1, 2, str(tmp_path), asynchronous)
    for message, committed in results:
        assert message is not None and "step-2 could not be written" in message and "\n" not in message
        assert "rank 1: OSError: [Errno 28] No space left on device" in message
        assert committed == [1]
    assert not list(tmp_path.rglob("*step-2*"))
