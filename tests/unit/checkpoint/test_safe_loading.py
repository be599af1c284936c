"""Loading unpickles nothing but DCP's index records; non-tensor state round-trips exactly through JSON."""

import json
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from optimus.checkpoint.manager import CheckpointError, CheckpointManager
from optimus.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner, read_index
from optimus.checkpoint.values import decode_values, encode_values, split_values
from optimus.train.state import ModelState
from tests.unit.checkpoint.tampering import plant_payload
from tests.unit.checkpoint.test_manager import make_state


def test_values_round_trip_exactly():
    tree = {"a": {"lr": 0.1 + 0.2, "betas": (0.9, 0.999), "flag": False, "none": None, "name": "adamw",
                  "steps": [1, (2, 3.5)], "empty": {}, "by_id": {0: "x"}, "inf": float("inf")},
            "w": torch.ones(2)}
    tensors, values = split_values(tree)
    assert list(tensors) == ["w"]
    decoded = decode_values(encode_values(values))
    assert decoded == dict(values)
    assert decoded[("a", "betas")] == (0.9, 0.999) and isinstance(decoded[("a", "steps")][1], tuple)
    assert decoded[("a", "by_id", 0)] == "x" and decoded[("a", "empty")] == {}


def test_unsupported_value_is_refused_at_save(tmp_path):
    class Odd:
        def state_dict(self):
            return {"dtype": torch.float32}

        def load_state_dict(self, state):
            pass

    from torch.distributed.checkpoint.stateful import Stateful
    Stateful.register(Odd)
    with pytest.raises(CheckpointError, match="odd.dtype' is a dtype"):
        CheckpointManager(tmp_path).save(1, {"odd": Odd()}, {})


def test_optimizer_hyperparameters_are_json_and_restored_exactly(tmp_path):
    model, optimizer, _, state = make_state()
    optimizer.param_groups[0].update(lr=0.1 + 0.2, betas=(0.8, 0.95), amsgrad=False)
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, {})
    folder = manager.step_dir(1)
    index = pickle.loads((folder / ".metadata").read_bytes())
    assert not [k for k, md in index.state_dict_metadata.items() if type(md).__name__ == "BytesStorageMetadata"]
    assert json.loads((folder / "values.json").read_text())["format"] == 1
    model2, optimizer2, _, state2 = make_state()
    optimizer2.param_groups[0].update(lr=5.0, betas=(0.1, 0.2))
    manager.load(1, state2)
    assert optimizer2.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    assert optimizer2.param_groups[0]["betas"] == (0.8, 0.95) and optimizer2.param_groups[0]["lr"] == 0.1 + 0.2


def test_payload_checkpoint_runs_nothing_and_fails_in_one_line(tmp_path):
    model, _, _, state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, {})
    plant_payload(manager.step_dir(1), "model.weight", tmp_path / "marker")
    assert manager.find_problem(1) is None  # the manifest is consistent: integrity alone cannot catch it

    with pytest.raises(CheckpointError, match="'model.weight' as pickled bytes where a tensor belongs") as err:
        manager.load(1, make_state()[3])
    assert "\n" not in str(err.value) and not (tmp_path / "marker").exists()

    # control: the stock DCP reader runs the payload (so the checkpoint above is a live exploit)
    with pytest.raises(BaseException):  # the payload's result is no tensor, but it has run by then
        dcp.load({"model": ModelState(torch.nn.Linear(4, 3))}, storage_reader=FileSystemReader(manager.step_dir(1)))
    assert (tmp_path / "marker").exists()


def test_payload_where_a_value_is_expected_is_read_weights_only(tmp_path):
    """A checkpoint from before values.json keeps hyperparameters as byte items: those are read with the
    weights-only unpickler, which refuses the payload."""
    model, optimizer, _, state = make_state()
    folder = tmp_path / "old"
    dcp.save(state, checkpoint_id=folder)  # the old layout: hyperparameters pickled by DCP
    _, optimizer2, _, state2 = make_state()
    optimizer2.param_groups[0]["lr"] = 7.0
    dcp.load(state2, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner())
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]  # old checkpoints still load

    plant_payload(folder, "optimizer.param_groups.weight.lr", tmp_path / "marker")
    with pytest.raises(BaseException, match="not plain data.*posix.system"):
        dcp.load(make_state()[3], storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner())
    assert not (tmp_path / "marker").exists()


def test_safe_reader_refuses_the_default_planner(tmp_path):
    _, _, _, state = make_state()
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, {})
    with pytest.raises(BaseException, match="only with SafeLoadPlanner"):
        dcp.load({"model": ModelState(torch.nn.Linear(4, 3))}, storage_reader=SafeFileSystemReader(manager.step_dir(1)))


def _call_global(module: str, name: str) -> bytes:
    """A protocol-4 pickle that looks up module.name and calls it with no arguments."""
    return b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\n)R."


def test_dotted_names_reach_through_any_module():
    """Why the index unpickler names each class: allowing a whole module lets a dotted name reach out of it."""
    import os

    assert pickle.loads(_call_global("torch.distributed.checkpoint.filesystem", "os.getcwd")) == os.getcwd()


@pytest.mark.parametrize("module, name", [
    ("torch.distributed.checkpoint.filesystem", "os.getcwd"),
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
    ("torch.distributed.checkpoint.metadata", "Any"),
    ("torch", "load"),
    ("torch", "float32.__class__"),
    ("builtins", "eval"),
])
def test_index_unpickler_allows_only_named_records(tmp_path, module, name):
    (tmp_path / ".metadata").write_bytes(_call_global(module, name))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        read_index(tmp_path)


def _rewrite_index(folder, **changes):
    """Point the index's first storage record elsewhere (the test's own file: plain pickle is fine here)."""
    import dataclasses

    metadata = pickle.loads((folder / ".metadata").read_bytes())
    first = next(iter(metadata.storage_data))
    metadata.storage_data[first] = dataclasses.replace(metadata.storage_data[first], **changes)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("changes, refusal", [
    ({"relative_path": "..\\secrets.distcp"}, "outside its folder"),
    ({"relative_path": "."}, "outside its folder"),
    ({"transform_descriptors": ["zip"]}, "asks to transform"),
])
def test_an_index_pointing_out_of_its_folder_or_asking_for_transforms_is_refused(tmp_path, changes, refusal):
    from optimus.checkpoint.safe_reader import UnsafeCheckpoint

    manager = CheckpointManager(tmp_path)
    manager.save(1, make_state()[3], {})
    _rewrite_index(manager.step_dir(1), **changes)
    with pytest.raises(UnsafeCheckpoint, match=refusal):
        read_index(manager.step_dir(1))


def test_per_rank_indexes_are_refused_for_rank_0_too_and_an_index_without_storage_meta_gets_one(tmp_path):
    from optimus.checkpoint.safe_reader import UnsafeCheckpoint

    manager = CheckpointManager(tmp_path)
    manager.save(1, make_state()[3], {})
    reader = SafeFileSystemReader(manager.step_dir(1))
    for rank in (0, 1):
        with pytest.raises(UnsafeCheckpoint, match="per-rank checkpoint indexes are not supported"):
            reader.read_metadata(rank=rank)
    reader._index.storage_meta = None  # an index written before DCP recorded storage_meta
    reader.reset()
    assert reader.read_metadata().storage_meta.load_id == reader.load_id


def test_a_refused_byte_item_with_an_empty_unpickler_message_still_fails_in_one_line(monkeypatch):
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from optimus.checkpoint import safe_reader
    from optimus.checkpoint.safe_reader import UnsafeCheckpoint

    def refuse(*_args, **_kwargs):
        raise pickle.UnpicklingError("")

    monkeypatch.setattr(safe_reader.torch, "load", refuse)
    planner = SafeLoadPlanner()
    planner.state_dict = {}
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("opt.lr"), torch.Size(()), MetadataIndex("opt.lr"),
                    torch.Size(()), torch.Size(()))
    with pytest.raises(UnsafeCheckpoint, match=r"'opt.lr' holds a pickle that is not plain data \(refused\)"):
        planner.load_bytes(item, io.BytesIO(b""))
