import pickle

import pytest
import torch
from torch import nn

from optimus.checkpoint.manager import CheckpointError, CheckpointManager
from optimus.checkpoint.safe_reader import SafeFileSystemReader
from optimus.train.state import ModelState, OptimizerState, ProgressState


def make_state():
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    progress = ProgressState()
    return model, optimizer, progress, {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
                                       "progress": progress}


def test_round_trip_latest_and_keep_last_k(tmp_path):
    model, optimizer, progress, state = make_state()
    manager = CheckpointManager(tmp_path, keep_last_k=2)
    for step in (1, 2, 3):
        progress.step = step
        manager.save(step, state, {"model": {}})
    assert manager.committed_steps() == [2, 3] and manager.latest() == 3
    saved_weight = model.weight.detach().clone()
    saved_moment = optimizer.state[model.weight]["exp_avg"].clone()

    model2, optimizer2, progress2, state2 = make_state()
    manager.load(3, state2)
    assert torch.equal(model2.weight, saved_weight) and progress2.step == 3
    assert torch.equal(optimizer2.state[model2.weight]["exp_avg"], saved_moment)


def test_uncommitted_checkpoint_is_ignored(tmp_path):
    _, _, _, state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, {})
    (tmp_path / "checkpoints" / "step-2").mkdir()  # a save that died before COMMITTED
    (tmp_path / "latest").write_text("2")
    assert manager.latest() == 1


def test_truncated_file_is_reported_in_one_line(tmp_path):
    _, _, _, state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, {})
    shard = next((tmp_path / "checkpoints" / "step-1").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError, match="damaged") as err:
        manager.load(1, make_state()[3])
    assert "\n" not in str(err.value)


class _Exploit:
    def __reduce__(self):
        return (print, ("pwned",))


def test_metadata_with_foreign_objects_is_not_unpickled(tmp_path):
    _, _, _, state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, {})
    path = tmp_path / "checkpoints" / "step-1"
    (path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        SafeFileSystemReader(path).read_metadata()


def test_stale_latest_pointer_naming_an_older_step_does_not_win(tmp_path):
    """A crash after step 2's folder was renamed into place but before `latest` was rewritten leaves the pointer on
    step 1: resume must still pick the newest committed checkpoint, not redo work from the older one."""
    _, _, _, state = make_state()
    manager = CheckpointManager(tmp_path, keep_last_k=3)
    manager.save(1, state, {})
    manager.save(2, state, {})
    (tmp_path / "latest").write_text("1")
    assert manager.latest() == 2
