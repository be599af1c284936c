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


def test_an_unreadable_latest_pointer_falls_back_to_the_newest_committed_step(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_k=3)
    for step in (1, 2):
        manager.save(step, make_state()[3], {})
    (tmp_path / "latest").write_text("two\n")
    assert manager.latest() == 2


def test_a_file_named_like_a_step_is_no_step_folder(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, make_state()[3], {})
    (manager.dir / "step-9").write_text("notes")
    assert manager.step_folders() == {1: True}
    assert manager.newest_usable() == (1, [])


def test_committing_an_older_step_than_the_kept_ones_never_prunes_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_k=2)
    for step in (5, 6, 3):
        manager.save(step, make_state()[3], {})
    assert manager.committed_steps() == [3, 5, 6]
    manager.save(7, make_state()[3], {})
    assert manager.committed_steps() == [6, 7]


def test_no_usable_checkpoint_names_the_newest_damaged_one_and_counts_the_rest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last_k=3)
    for step in (1, 2, 3):
        manager.save(step, make_state()[3], {})
        (manager.step_dir(step) / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"step-3 is damaged \(file 'meta.json' is 2 bytes, .*\) \(and 2 older "
                                              r"ones\) and no earlier one is usable"):
        manager.newest_usable()


@pytest.mark.parametrize("committed, free, note", [
    ((1,), "size", ""),  # exactly a checkpoint's room left: not full
    ((), 1 << 20, "; the disk is full (1.0 MiB free, a checkpoint takes about 16.0 MiB)"),  # no earlier one: 16 MiB
])
def test_the_disk_full_note_at_its_boundary_and_without_an_earlier_checkpoint(tmp_path, monkeypatch, committed, free,
                                                                              note):
    from types import SimpleNamespace

    from torch.distributed.checkpoint import FileSystemWriter

    from optimus.checkpoint import manager as manager_module

    manager = CheckpointManager(tmp_path)
    for step in committed:
        manager.save(step, make_state()[3], {})
    if free == "size":
        free = sum(p.stat().st_size for p in manager.step_dir(1).iterdir())

    def write_fails(self, plan, planner):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(FileSystemWriter, "write_data", write_fails)
    monkeypatch.setattr(manager_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=free))
    with pytest.raises(CheckpointError) as err:
        manager.save(2, make_state()[3], {})
    assert f"Input/output error){note}: check free space" in str(err.value)


def test_a_checkpoint_that_passed_its_check_is_not_hashed_again_in_the_same_process(tmp_path, monkeypatch):
    from optimus.checkpoint import manager as manager_module

    manager = CheckpointManager(tmp_path)
    manager.save(1, make_state()[3], {})
    calls, check_files = [], manager_module.check_files
    monkeypatch.setattr(manager_module, "check_files", lambda *args: calls.append(1) or check_files(*args))
    assert manager.newest_usable() == (1, [])
    manager.load(1, make_state()[3])
    assert manager.find_problem(1) is None and len(calls) == 1


def test_a_failure_is_described_by_its_first_line():
    from optimus.checkpoint.manager import _describe

    failure = RuntimeError("  disk gone\nTraceback (most recent call last):\n  more")
    assert _describe(failure) == "RuntimeError: disk gone"
    assert _describe(OSError()) == "OSError"


@pytest.mark.parametrize("meta", [{}, {"step": 3}, {"model": {}, "contents": []}])
def test_meta_without_model_or_contents_is_accepted(meta):
    from optimus.checkpoint.manager import check_meta

    check_meta(meta)


def test_a_checkpoint_from_before_values_json_restores_its_pickled_values(tmp_path):
    """Older checkpoints kept optimizer hyperparameters as DCP byte items (no values.json): loading reads them
    (weights-only) into the live state."""
    import json

    import torch.distributed.checkpoint as dcp

    from optimus.checkpoint.integrity import seal

    _, optimizer, _, state = make_state()
    optimizer.param_groups[0]["lr"] = 0.125
    manager = CheckpointManager(tmp_path)
    folder = manager.step_dir(1)
    dcp.save(state, checkpoint_id=folder)
    (folder / "meta.json").write_text(json.dumps({"step": 1}))
    seal(folder)
    model2, optimizer2, _, state2 = make_state()
    manager.load(1, state2)
    assert optimizer2.param_groups[0]["lr"] == 0.125


class _Masters:
    """A Stateful whose 'master' entry may be read from 'weight' where the checkpoint lacks its own."""

    def __init__(self, weight, master):
        self.weight, self.master = weight, master

    def state_dict(self):
        return {"weight": self.weight, "master": self.master}

    def load_state_dict(self, state):
        self.weight.copy_(state["weight"]), self.master.copy_(state["master"])

    def stand_ins(self):
        return {"master": "m.weight"}


def test_a_stand_in_is_read_only_where_the_checkpoint_lacks_the_entry_itself(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"m": _Masters(torch.full((2,), 1.0), torch.full((2,), 2.0))}, {})
    loaded = _Masters(torch.zeros(2), torch.zeros(2))
    manager.load(1, {"m": loaded})
    assert loaded.weight.tolist() == [1.0, 1.0] and loaded.master.tolist() == [2.0, 2.0]
