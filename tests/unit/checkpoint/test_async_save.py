"""Asynchronous saves: committed only once written, equal to a synchronous save, safe when the write fails."""

import threading

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from optimus.checkpoint.manager import CheckpointError, CheckpointManager
from tests.unit.checkpoint.test_manager import make_state


def loaded_tensors(manager: CheckpointManager, step: int) -> dict[str, torch.Tensor]:
    model, optimizer, _, state = make_state()
    manager.load(step, state)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for name, param in model.named_parameters():
        tensors.update({f"optimizer.{name}.{k}": v for k, v in optimizer.state[param].items()})
    return tensors


@pytest.fixture
def held_write(monkeypatch):
    """Background writes wait until the test calls release(): what happens meanwhile is then certain."""
    release, original = threading.Event(), FileSystemWriter.write_data

    def write_data(self, plan, planner):
        assert release.wait(timeout=60), "the test never released the write"
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    return release.set


def test_async_save_is_committed_by_finish_and_equals_a_sync_save(tmp_path, held_write):
    _, _, progress, state = make_state()
    progress.step = 1
    sync, background = CheckpointManager(tmp_path / "sync"), CheckpointManager(tmp_path / "async")
    background.save(1, state, {"model": {}}, asynchronous=True)
    assert background.committed_steps() == [] and background.latest() is None
    assert (background.dir / ".tmp-step-1").is_dir() and not (background.dir / ".tmp-step-1" / "COMMITTED").exists()
    held_write()
    sync.save(1, state, {"model": {}})
    assert background.finish_pending() == 1 and background.finish_pending() is None
    assert background.committed_steps() == [1] and background.latest() == 1
    assert background.read_meta(1) == sync.read_meta(1)
    want, got = loaded_tensors(sync, 1), loaded_tensors(background, 1)
    assert want.keys() == got.keys() and len(want) == 8  # weight, bias, and each one's step, exp_avg, exp_avg_sq
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_state_changed_after_save_returns_is_not_in_the_checkpoint(tmp_path, held_write):
    model, optimizer, _, state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, {}, asynchronous=True)
    weight, moment = model.weight.detach().clone(), optimizer.state[model.weight]["exp_avg"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    optimizer.state[model.weight]["exp_avg"].mul_(3.0)
    held_write()  # the files are written only now, from the copy taken during save()
    manager.finish_pending()
    got = loaded_tensors(manager, 1)
    assert torch.equal(got["model.weight"], weight) and torch.equal(got["optimizer.weight.exp_avg"], moment)


def test_next_save_and_load_commit_the_pending_save_first(tmp_path):
    _, _, progress, state = make_state()
    manager = CheckpointManager(tmp_path, keep_last_k=3)
    for step in (1, 2):
        progress.step = step
        manager.save(step, state, {}, asynchronous=True)
    assert manager.committed_steps() == [1]
    manager.load(1, make_state()[3])
    assert manager.committed_steps() == [1, 2] and manager.latest() == 2


def failing_write(self, plan, planner):
    raise OSError(28, "No space left on device")


def test_failed_background_write_raises_one_line_and_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    model, _, progress, state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, {}, asynchronous=True)
    manager.finish_pending()
    weight = model.weight.detach().clone()
    monkeypatch.setattr(FileSystemWriter, "write_data", failing_write)
    progress.step = 2
    manager.save(2, state, {}, asynchronous=True)
    with pytest.raises(CheckpointError, match=r"step-2 could not be written \(.*No space left on device") as err:
        manager.finish_pending()
    assert "\n" not in str(err.value)
    assert manager.committed_steps() == [1] and manager.latest() == 1
    assert not list(tmp_path.rglob("step-2")) and not list(tmp_path.rglob(".tmp-step-2"))
    assert manager.finish_pending() is None  # the failed save is gone, not retried
    assert torch.equal(loaded_tensors(manager, 1)["model.weight"], weight)


def test_on_exit_a_written_save_is_committed_and_a_failed_one_dropped(tmp_path, monkeypatch):
    _, _, _, state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, {}, asynchronous=True)
    assert manager.finish_pending_on_exit() == 1 and manager.latest() == 1
    monkeypatch.setattr(FileSystemWriter, "write_data", failing_write)
    manager.save(2, state, {}, asynchronous=True)
    assert manager.finish_pending_on_exit() is None
    assert manager.committed_steps() == [1] and not list(tmp_path.rglob("COMMITTED"))[1:]
