"""The checkpoint's non-tensor values (checkpoint/values.py): each rank writes its own file, rank 0 folds them."""

from __future__ import annotations

import json

from optimus.checkpoint.values import VALUES, encode_values, merge_rank_values, read_values


def test_ranks_value_files_fold_in_rank_order_the_lowest_rank_keeping_a_shared_path(tmp_path):
    """A path several ranks saved (a replicated setting) keeps the lowest rank's value, as DCP keeps one copy of a
    replicated item; a path one rank alone saved (its pipeline stage's) is kept. Rank 10 comes after rank 2 (the
    file names sort the other way as text)."""
    files = {0: [(("optimizer", "lr"), 0.1), (("stage", "0"), "first")],
             2: [(("optimizer", "lr"), 0.2), (("stage", "2"), "third"), (("shared", "x"), 2)],
             10: [(("optimizer", "lr"), 1.0), (("stage", "10"), "eleventh"), (("shared", "x"), 10)]}
    for rank, values in files.items():
        (tmp_path / f"__{rank}_{VALUES}").write_text(encode_values(values))
    merge_rank_values(tmp_path)
    assert read_values(tmp_path) == {("optimizer", "lr"): 0.1, ("stage", "0"): "first", ("stage", "2"): "third",
                                     ("shared", "x"): 2, ("stage", "10"): "eleventh"}
    assert json.loads((tmp_path / VALUES).read_text())["format"] == 1


def test_a_dict_with_int_keys_inside_a_list_is_a_value_and_round_trips():
    from optimus.checkpoint.values import decode_values, split_values

    tensors, values = split_values({"opt": {"groups": [{0: 1.5, "lr": (1, 2)}]}})
    assert tensors == {} and values == [(("opt", "groups"), [{0: 1.5, "lr": (1, 2)}])]
    assert decode_values(encode_values(values)) == {("opt", "groups"): [{0: 1.5, "lr": (1, 2)}]}


def test_values_of_another_format_or_with_extra_tags_are_refused():
    import pytest

    from optimus.checkpoint.values import decode_values

    with pytest.raises(ValueError, match="is not an Optimus values file"):
        decode_values('{"format": 2, "values": []}')
    with pytest.raises(ValueError, match="unexpected object"):
        decode_values('{"format": 1, "values": [[["a"], {"__tuple__": [1], "x": 2}]]}')
    with pytest.raises(ValueError, match="unexpected object"):
        decode_values('{"format": 1, "values": [[["a"], {"__dict__": [], "x": 2}]]}')
