"""Non-tensor state (optimizer hyperparameters, flags, names) kept as JSON beside the DCP tensors.

DCP would store every non-tensor value as a pickle and read it back with a general unpickler, so a
checkpoint could carry code. Here the state to save is split in two: tensors go to DCP, everything
else to a JSON list of (path, value) pairs. Tuples and dicts are tagged so that loading rebuilds the
very same Python values (a float survives JSON exactly: Python writes the shortest repr that reads back).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from optimus.checkpoint.integrity import write_json_durably

VALUES = "values.json"
_TUPLE, _DICT = "__tuple__", "__dict__"

ValuePath = tuple[Any, ...]  # keys from the top of a state dict down to one value


class UnsupportedValue(TypeError):
    """A piece of state that is neither a tensor nor a plain JSON value."""


def live_state(state: dict[str, Any]) -> dict[str, Any]:
    """What DCP would see: each Stateful replaced by its state_dict() (plain dicts kept as they are)."""
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}


def split_values(tree: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[ValuePath, Any]]]:
    """(the tree with only its tensors, every other leaf as (path, value)); nested dicts are walked."""
    values: list[tuple[ValuePath, Any]] = []

    def walk(node: dict, path: ValuePath) -> dict:
        kept = {}
        for key, value in node.items():
            if isinstance(value, torch.Tensor):
                kept[key] = value
            elif isinstance(value, dict) and value:
                inner = walk(value, (*path, key))
                if inner:  # a dict with no tensors at all lives in the values only
                    kept[key] = inner
            else:
                _check_plain(value, (*path, key))
                values.append(((*path, key), value))
        return kept

    return walk(tree, ()), values


def _check_plain(value: Any, path: ValuePath) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, (*path, index))
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise UnsupportedValue(f"state key {key!r} under '{_dotted(path)}' is neither a string nor an int")
            _check_plain(item, (*path, key))
        return
    raise UnsupportedValue(
        f"state '{_dotted(path)}' is a {type(value).__name__}, neither a tensor nor a plain value (number, string, "
        "bool, None, list, tuple, dict): store it as a tensor"
    )


def _dotted(path: ValuePath) -> str:
    return ".".join(str(key) for key in path)


def _encode(value: Any) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(item) for item in value]}
    if isinstance(value, list):
        return [_encode(item) for item in value]
    if isinstance(value, dict):
        return {_DICT: [[key, _encode(item)] for key, item in value.items()]}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(item) for item in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_decode(item) for item in value[_TUPLE])
        if set(value) == {_DICT}:
            return {key: _decode(item) for key, item in value[_DICT]}
        raise ValueError(f"unexpected object {sorted(value)[:3]} in {VALUES}")
    return value


def encode_values(values: list[tuple[ValuePath, Any]]) -> str:
    """The JSON text of (path, value) pairs."""
    return json.dumps({"format": 1, "values": [[list(path), _encode(value)] for path, value in values]})


def decode_values(text: str) -> dict[ValuePath, Any]:
    """Inverse of encode_values, keyed by path (ValueError on anything that is not such a file)."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != 1 or not isinstance(data.get("values"), list):
        raise ValueError(f"{VALUES} is not an Optimus values file")
    return {tuple(path): _decode(value) for path, value in data["values"]}


def merge_value_files(texts: list[str]) -> str:
    """One values file from the ones every rank wrote; a path saved by several ranks keeps the first rank's value
    (DCP keeps one copy of a replicated item the same way)."""
    merged: dict[ValuePath, Any] = {}
    for text in texts:
        for path, value in decode_values(text).items():
            merged.setdefault(path, value)
    return encode_values(list(merged.items()))


def read_values(checkpoint: Path) -> dict[ValuePath, Any] | None:
    """The checkpoint's saved values; None for a checkpoint written before values were kept as JSON."""
    path = checkpoint / VALUES
    if not path.is_file():
        return None
    return decode_values(path.read_text())


def restore_values(tree: dict[str, Any], saved: dict[ValuePath, Any]) -> None:
    """Put the saved values back into `tree` (in place) where the live state has a non-tensor at the same path.

    Values saved for state this process does not hold (another pipeline stage's parameters) are skipped;
    a live value the checkpoint lacks keeps its current setting.
    """
    _, live = split_values(tree)
    for path, _ in live:
        if path in saved:
            node = tree
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = saved[path]


def merge_rank_values(folder: Path) -> None:
    """Rank 0 at commit: fold the per-rank `__<rank>_values.json` files into one `values.json`."""
    parts = sorted(folder.glob(f"__*_{VALUES}"), key=lambda p: int(p.name.split("_")[2]))
    write_json_durably(folder / VALUES, merge_value_files([part.read_text() for part in parts]))
    for part in parts:
        part.unlink()
