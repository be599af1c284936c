"""Every file's size and hash are checked before a load; resume falls back past damaged checkpoints."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from optimus.checkpoint.integrity import read_manifest
from optimus.checkpoint.manager import CheckpointError, CheckpointManager
from optimus.checkpoint.verify import verify_run
from optimus.train.state import ModelState
from tests.unit.checkpoint.tampering import flip_bytes_in_tensor
from tests.unit.checkpoint.test_manager import make_state


def saved_run(tmp_path, steps=(1, 2), keep_last_k=3):
    model, _, progress, state = make_state()
    manager = CheckpointManager(tmp_path, keep_last_k=keep_last_k)
    weights = {}
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        progress.step = step
        manager.save(step, state, {"model": {}})
        weights[step] = model.weight.detach().clone()
    return manager, weights


def test_manifest_records_size_and_hash_of_every_file(tmp_path):
    manager, _ = saved_run(tmp_path, steps=(1,))
    folder = manager.step_dir(1)
    records = read_manifest(folder)
    assert set(records) == {p.name for p in folder.iterdir()} - {"COMMITTED"}
    assert {".metadata", "meta.json", "values.json", "__0_0.distcp"} <= set(records)
    assert all(len(r.blake2b) == 64 and r.size == (folder / n).stat().st_size for n, r in records.items())
    assert not list(folder.glob("__*_values.json")) and not list(folder.glob("*hashes.json"))  # sidecars merged


def test_flipped_bytes_are_caught_where_plain_dcp_loads_them_silently(tmp_path):
    manager, weights = saved_run(tmp_path)
    shard = flip_bytes_in_tensor(manager.step_dir(2), weights[2])
    linear = torch.nn.Linear(4, 3)
    dcp.load({"model": ModelState(linear)}, storage_reader=FileSystemReader(manager.step_dir(2)))
    assert not torch.equal(linear.weight, weights[2])  # control: DCP alone hands back wrong weights, no word

    assert f"'{shard.name}' does not match its BLAKE2b hash" in manager.find_problem(2)
    with pytest.raises(CheckpointError, match=f"step-2 is damaged .*{shard.name}") as err:
        manager.load(2, make_state()[3])
    assert "\n" not in str(err.value)


def test_resume_falls_back_to_the_newest_good_checkpoint_and_keeps_the_bad_one(tmp_path):
    manager, weights = saved_run(tmp_path, steps=(1, 2, 3))
    flip_bytes_in_tensor(manager.step_dir(3), weights[3])
    shard = manager.step_dir(2) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated
    bad3, bad2 = (sorted(p.read_bytes() for p in manager.step_dir(s).iterdir()) for s in (3, 2))

    step, skipped = CheckpointManager(tmp_path, keep_last_k=3).newest_usable()
    assert step == 1 and len(skipped) == 2
    assert skipped[0].startswith("step-3 (file '__0_0.distcp' does not match") and "damaged-step-3" in skipped[0]
    assert "step-2 (file '__0_0.distcp' is" in skipped[1] and "truncated" in skipped[1]
    assert manager.committed_steps() == [1] and manager.latest() == 1
    for s, before in ((3, bad3), (2, bad2)):  # moved aside byte for byte, not deleted
        assert sorted(p.read_bytes() for p in (manager.dir / f"damaged-step-{s}").iterdir()) == before

    # training goes on from step 1: pruning counts only good checkpoints, the damaged ones stay
    model, _, progress, state = make_state()
    again = CheckpointManager(tmp_path, keep_last_k=1)
    again.load(1, state)
    assert torch.equal(model.weight, weights[1])
    progress.step = 2
    again.save(2, state, {"model": {}})
    assert again.committed_steps() == [2]
    assert sorted(p.name for p in again.dir.iterdir()) == ["damaged-step-2", "damaged-step-3", "step-2"]
    reports = {r.name: r for r in verify_run(tmp_path)}
    assert reports["step-2"].ok and not reports["damaged-step-3"].ok
    assert "moved aside" in reports["damaged-step-2"].problem and "truncated" in reports["damaged-step-2"].problem


def test_no_good_checkpoint_is_one_line_and_moves_nothing(tmp_path):
    manager, weights = saved_run(tmp_path, steps=(1,))
    flip_bytes_in_tensor(manager.step_dir(1), weights[1])
    with pytest.raises(CheckpointError, match="step-1 is damaged .* no earlier one is usable") as err:
        manager.newest_usable()
    assert "\n" not in str(err.value) and manager.committed_steps() == [1]


def test_manifest_without_index_or_meta_is_damaged(tmp_path):
    manager, _ = saved_run(tmp_path, steps=(1,))
    committed = manager.step_dir(1) / "COMMITTED"
    data = json.loads(committed.read_text())
    del data["files"][".metadata"]
    committed.write_text(json.dumps(data))
    assert manager.find_problem(1) == "COMMITTED does not list '.metadata'"
    committed.write_text("[1, 2]")
    assert "not a manifest" in manager.find_problem(1)


def test_sizes_only_manifest_of_older_checkpoints_still_loads(tmp_path):
    manager, weights = saved_run(tmp_path, steps=(1,))
    folder = manager.step_dir(1)
    (folder / "COMMITTED").write_text(json.dumps({n: r.size for n, r in read_manifest(folder).items()}))
    model, _, _, state = make_state()
    manager.load(1, state)
    assert torch.equal(model.weight, weights[1])


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    manager, weights = saved_run(tmp_path, steps=(1,))
    before = {p.name: p.read_bytes() for p in manager.step_dir(1).iterdir()}

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    _, _, _, state = make_state()
    with pytest.raises(CheckpointError, match=r"step-2 could not be written \(.*No space left on device") as err:
        manager.save(2, state, {"model": {}})
    assert "\n" not in str(err.value)
    assert manager.committed_steps() == [1] and manager.latest() == 1
    assert not list(tmp_path.rglob("*step-2*"))
    assert {p.name: p.read_bytes() for p in manager.step_dir(1).iterdir()} == before
    assert manager.find_problem(1) is None


def test_commit_failure_is_one_line(tmp_path):
    manager, _ = saved_run(tmp_path, steps=(1,))
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()  # the pointer cannot be replaced
    with pytest.raises(CheckpointError, match="step-2 could not be written") as err:
        manager.save(2, make_state()[3], {})
    assert "\n" not in str(err.value)


def test_every_file_a_commit_relies_on_is_fsynced_before_it_is_put_in_place(tmp_path, monkeypatch):
    """A crash (power lost) just after a commit must find on disk the bytes the commit points to: each small file
    (meta.json, COMMITTED, latest) is fsynced before the rename that puts it in place, DCP's data files (its
    sync_files) before COMMITTED is, and the step's folder takes its final name only after COMMITTED is in it."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        real_fsync(fd)

    def replace(source, target, *args, **kwargs):
        events.append(("replace", Path(source).name, Path(target).name))
        real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    manager, _ = saved_run(tmp_path, steps=(1,))
    for name in ("meta.json", "COMMITTED", "latest"):
        assert events.index(("fsync", f"{name}.tmp")) < events.index(("replace", f"{name}.tmp", name)), name
    committed = events.index(("replace", "COMMITTED.tmp", "COMMITTED"))
    data = [path.name for path in manager.step_dir(1).glob("*.distcp")]
    assert data and all(events.index(("fsync", name)) < committed for name in data)
    renamed = [at for at, event in enumerate(events) if event[0] == "replace" and event[2] == manager.step_dir(1).name]
    assert renamed and min(renamed) > committed
    # A rename is a change to the folder it lands in: each is made durable (the folder fsynced) before the next
    # step relies on it: COMMITTED inside the step's folder before the folder is renamed, the folder's final name
    # before `latest` names it, `latest` itself after its rename.
    folder_synced = [at for at, event in enumerate(events) if event == ("fsync", f".tmp-step-{1}")]
    assert any(committed < at < min(renamed) for at in folder_synced)
    latest = events.index(("replace", "latest.tmp", "latest"))
    checkpoints_synced = [at for at, event in enumerate(events) if event == ("fsync", manager.dir.name)]
    assert any(min(renamed) < at < latest for at in checkpoints_synced)
    assert events[latest + 1] == ("fsync", manager.run_dir.name)


def test_flipped_bytes_in_the_dcp_index_are_caught(tmp_path):
    """DCP's `.metadata` index says where every tensor lives: bit rot there (same size) must be found by the check
    before a load, like in any shard, not only the data files."""
    manager, _ = saved_run(tmp_path, steps=(1,))
    index = manager.step_dir(1) / ".metadata"
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 0xFF
    index.write_bytes(bytes(data))
    assert manager.find_problem(1).startswith("file '.metadata' does not match its BLAKE2b hash")


def test_a_step_committed_again_after_its_check_is_checked_again(tmp_path):
    """A passed check is remembered only for the files it read: once step 1 is saved anew (its old folder moved
    aside), damage in the new files must still be found."""
    manager, _ = saved_run(tmp_path, steps=(1,))
    assert manager.find_problem(1) is None
    model, _, _, state = make_state()
    manager.save(1, state, {"model": {}})
    flip_bytes_in_tensor(manager.step_dir(1), model.weight)
    problem = manager.find_problem(1)
    assert problem is not None and "does not match its BLAKE2b hash" in problem


def _save_and_damage_step_2_then_resume(manager):
    """Save step 2, truncate its shard, resume: step 2 is moved aside; returns the note on it."""
    manager.save(2, make_state()[3], {"model": {}})
    shard = manager.step_dir(2) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-7])
    step, (note,) = manager.newest_usable()
    assert step == 1
    return note


def test_a_step_moved_aside_a_third_time_gets_a_free_name(tmp_path):
    """A run that keeps damaging the same step (a failing disk) must keep every damaged copy and keep resuming:
    each move aside picks the next free name, never fails on an existing one."""
    manager, _ = saved_run(tmp_path, steps=(1,))
    notes = [_save_and_damage_step_2_then_resume(manager) for _ in range(3)]
    assert [note.rsplit("kept as ", 1)[1] for note in notes] == [
        "checkpoints/damaged-step-2)", "checkpoints/damaged-step-2.2)", "checkpoints/damaged-step-2.3)"]
    assert sorted(p.name for p in manager.dir.iterdir()) == [
        "damaged-step-2", "damaged-step-2.2", "damaged-step-2.3", "step-1"]


def test_verify_lists_a_step_moved_aside_twice(tmp_path):
    """`optimus verify` must account for every folder resume set aside, including the second copy of a step
    (damaged-step-N.2), so the user sees all the damaged copies kept on disk."""
    manager, _ = saved_run(tmp_path, steps=(1,))
    for _ in range(2):
        _save_and_damage_step_2_then_resume(manager)
    reports = verify_run(tmp_path)
    assert [(r.name, r.step, r.ok) for r in reports] == [
        ("step-1", 1, True), ("damaged-step-2", 2, False), ("damaged-step-2.2", 2, False)]


def test_verify_reports_oldest_first_whatever_order_the_folder_lists(tmp_path, monkeypatch):
    """The verify report reads top to bottom from the oldest step (numerically: step-10 after step-2), whatever
    order the filesystem lists the folders in (here: newest name first)."""
    saved_run(tmp_path, steps=(2, 10))
    (tmp_path / "checkpoints" / "damaged-step-3").mkdir()
    listing = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(sorted(listing(self), reverse=True)))
    assert [r.name for r in verify_run(tmp_path)] == ["step-2", "damaged-step-3", "step-10"]


def test_verify_reports_a_manifest_that_does_not_list_the_index(tmp_path):
    """`optimus verify` must call a checkpoint whose COMMITTED omits `.metadata` damaged, as resume does: the
    index is then unchecked, so verify saying "ok" would promise a load that resume refuses."""
    manager, _ = saved_run(tmp_path, steps=(1,))
    committed = manager.step_dir(1) / "COMMITTED"
    data = json.loads(committed.read_text())
    del data["files"][".metadata"]
    committed.write_text(json.dumps(data))
    (report,) = verify_run(tmp_path)
    assert report.problem == "COMMITTED does not list '.metadata'"


def test_read_meta_refuses_a_file_larger_than_committed_says(tmp_path):
    """Bytes appended to a shard (an overwrite, a botched copy) make it not the file that was committed: resume's
    cheap size check must refuse it, not only files that shrank."""
    manager, _ = saved_run(tmp_path, steps=(1,))
    assert manager.read_meta(1)["step"] == 1
    shard = manager.step_dir(1) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes() + b"extra")
    with pytest.raises(CheckpointError, match="step-1 is damaged .*'__0_0.distcp' is .* bytes, COMMITTED says"):
        manager.read_meta(1)


def test_read_meta_refuses_contents_that_are_not_names(tmp_path):
    """meta.json's 'contents' is a list of names the trainer looks up: a non-string there is refused as a damaged
    checkpoint in one line, not a crash later in the trainer."""
    manager = CheckpointManager(tmp_path)
    manager.save(1, make_state()[3], {"model": {}, "contents": ["model", 3]})
    with pytest.raises(CheckpointError, match="'contents' is not a list of names") as err:
        manager.read_meta(1)
    assert "\n" not in str(err.value)


def test_read_meta_names_a_meta_json_that_is_not_json(tmp_path):
    """An edited meta.json committed with its new hash said only "JSONDecodeError: Expecting property name": the
    message names the file."""
    from optimus.checkpoint.integrity import seal

    manager = CheckpointManager(tmp_path)
    manager.save(1, make_state()[3], {"model": {}, "contents": ["model"]})
    (manager.step_dir(1) / "meta.json").write_text("{not json")
    (manager.step_dir(1) / "COMMITTED").unlink()
    seal(manager.step_dir(1))
    with pytest.raises(CheckpointError, match=r"is damaged \(meta.json is not JSON: Expecting property name") as err:
        manager.read_meta(1)
    assert "\n" not in str(err.value)


def test_the_disk_full_note_appears_only_when_free_space_is_below_a_checkpoint(tmp_path, monkeypatch):
    """A failed save says "the disk is full" only when it is: with room for a checkpoint left, the note would send
    the user after the wrong cause."""
    from optimus.checkpoint import manager as manager_module

    manager, _ = saved_run(tmp_path, steps=(1,))
    size = sum(p.stat().st_size for p in manager.step_dir(1).iterdir())

    def write_fails(self, plan, planner):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(FileSystemWriter, "write_data", write_fails)
    for free, full in ((size - 1, True), (size * 1000, False)):
        monkeypatch.setattr(manager_module.shutil, "disk_usage", lambda path, free=free: SimpleNamespace(free=free))
        with pytest.raises(CheckpointError) as err:
            manager.save(2, make_state()[3], {"model": {}})
        assert ("the disk is full" in str(err.value)) == full, (free, str(err.value))


@pytest.mark.parametrize("text", ['{"format": 3, "files": {"meta.json": {"bytes": 2, "blake2b": "ab"}}}',
                                  '{"meta.json": "12"}', '{"meta.json": 1.5}'])
def test_a_manifest_of_another_format_or_with_sizes_that_are_not_whole_numbers_is_refused(tmp_path, text):
    """Neither this format nor the older sizes-only one (name -> whole number of bytes): not read as sizes."""
    from optimus.checkpoint.integrity import ManifestError

    (tmp_path / "COMMITTED").write_text(text)
    with pytest.raises(ManifestError, match="^COMMITTED is not a manifest Optimus wrote$"):
        read_manifest(tmp_path)


def test_a_manifest_name_with_a_folder_in_it_is_refused_even_where_that_file_matches(tmp_path):
    """COMMITTED lists the step folder's own files: a listed path into a subfolder (or out of the folder) is not one
    of them, though a file there has the recorded size and hash."""
    import hashlib

    from optimus.checkpoint.integrity import FileRecord, check_files

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"abc")
    record = FileRecord(3, hashlib.blake2b(b"abc", digest_size=32).hexdigest())
    assert check_files(tmp_path, {"sub/a.bin": record}) == "COMMITTED lists 'sub/a.bin', which is not a file name"


def test_a_manifest_never_lists_itself_even_when_sealed_again(tmp_path):
    """COMMITTED changes as it is written: listed in itself, its own recorded size and hash would be stale at
    once and the checkpoint would check as damaged. Sealing a folder a second time lists the data files only."""
    from optimus.checkpoint.integrity import check_files, seal

    (tmp_path / "a.bin").write_bytes(b"abc")
    seal(tmp_path)
    seal(tmp_path)
    records = read_manifest(tmp_path)
    assert set(records) == {"a.bin"} and check_files(tmp_path, records) is None


@pytest.mark.parametrize("name", ["", ".", ".."])
def test_a_manifest_name_for_the_folder_itself_or_its_parent_is_refused(tmp_path, name):
    """'.' or '..' with the folder's size in a sizes-only manifest would otherwise check as a good file."""
    from optimus.checkpoint.integrity import FileRecord, check_files

    record = FileRecord((tmp_path / name).stat().st_size, None)
    assert check_files(tmp_path, {name: record}) == f"COMMITTED lists '{name}', which is not a file name"


def test_a_manifest_size_that_is_not_a_number_is_refused_in_one_line(tmp_path):
    from optimus.checkpoint.integrity import ManifestError

    (tmp_path / "COMMITTED").write_text('{"format": 2, "files": {"meta.json": {"bytes": "ten", "blake2b": "ab"}}}')
    with pytest.raises(ManifestError, match="^COMMITTED is not a manifest Optimus wrote$"):
        read_manifest(tmp_path)


def test_verify_takes_the_step_of_a_third_moved_aside_copy_before_its_suffix(tmp_path):
    (tmp_path / "checkpoints" / "damaged-step-5.3").mkdir(parents=True)
    (report,) = verify_run(tmp_path)
    assert (report.name, report.step, report.files, report.bytes) == ("damaged-step-5.3", 5, 0, 0)


def test_verify_reports_the_bytes_of_a_checkpoint(tmp_path):
    manager, _ = saved_run(tmp_path, steps=(1,))
    files = [p for p in manager.step_dir(1).iterdir()]
    (report,) = verify_run(tmp_path)
    assert (report.files, report.bytes) == (len(files), sum(p.stat().st_size for p in files))
    assert report.bytes > report.files


def test_verify_refuses_a_pickled_index_item_only_in_a_checkpoint_with_values_json(tmp_path, monkeypatch):
    """Optimus keeps values in values.json, so a pickled item in such a checkpoint's index was put there by someone
    else; a checkpoint from before values.json held its values pickled, and is not refused for it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from optimus.checkpoint import verify
    from optimus.checkpoint.integrity import seal

    manager, _ = saved_run(tmp_path, steps=(1,))
    read_index = verify.read_index

    def with_pickled_item(folder):
        index = read_index(folder)
        index.state_dict_metadata["extra"] = BytesStorageMetadata()
        return index

    monkeypatch.setattr(verify, "read_index", with_pickled_item)
    folder = manager.step_dir(1)
    assert verify.check_checkpoint(folder) == (
        "index holds pickled item 'extra', which Optimus never writes (altered checkpoint)")
    (folder / "values.json").unlink()
    (folder / "COMMITTED").unlink()
    seal(folder)
    assert verify.check_checkpoint(folder) is None
