"""Memmap datasets and their windows (optimus/data/dataset.py)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from optimus.data.dataset import TokenDataset, open_token_dataset
from optimus.data.errors import DataError


def test_windows_tile_the_token_stream(sotu_tokenized):
    dataset = open_token_dataset(sotu_tokenized)
    tokens = np.fromfile(sotu_tokenized / "train.bin", dtype=np.uint16)
    seq_len = 64
    count = dataset.num_instances(seq_len)
    assert count == len(tokens) // (seq_len + 1) and dataset.num_tokens == len(tokens)
    windows = [dataset.instance(i, seq_len) for i in range(count)]
    assert all(w.dtype == np.int64 and w.shape == (seq_len + 1,) for w in windows)
    np.testing.assert_array_equal(np.concatenate(windows), tokens[: count * (seq_len + 1)])
    with pytest.raises(IndexError):
        dataset.instance(count, seq_len)
    assert len(dataset.document_ends()) == 3 and dataset.eos_id == 50279


def test_directory_file_and_split_forms_agree(sotu_tokenized):
    assert TokenDataset(sotu_tokenized).path == TokenDataset(sotu_tokenized / "train.bin").path
    heldout = open_token_dataset(sotu_tokenized, split="heldout")
    assert heldout.path.name == "heldout.bin" and heldout.meta["split"] == "heldout"
    assert open_token_dataset(sotu_tokenized / "heldout.bin").num_tokens == heldout.num_tokens


def test_pickling_reopens_instead_of_copying(sotu_tokenized):
    dataset = TokenDataset(sotu_tokenized)
    payload = pickle.dumps(dataset)
    assert len(payload) < 1000
    np.testing.assert_array_equal(pickle.loads(payload).instance(3, 32), dataset.instance(3, 32))


def test_errors_name_the_problem_and_the_fix(tmp_path, write_token_file):
    with pytest.raises(DataError, match="does not exist: create it with `optimus tokenize"):
        TokenDataset(tmp_path / "missing.bin")
    with pytest.raises(DataError, match="re-run `optimus tokenize` with --heldout-fraction"):
        open_token_dataset(tmp_path, split="heldout")
    orphan = tmp_path / "orphan.bin"
    np.arange(10, dtype=np.uint16).tofile(orphan)
    with pytest.raises(DataError, match="has no sidecar orphan.json"):
        TokenDataset(orphan)
    short = write_token_file(tmp_path / "short.bin", np.arange(10))
    with pytest.raises(DataError, match=r"has 10 tokens, fewer than seq_len \+ 1 = 17: use a shorter"):
        TokenDataset(short).num_instances(16)
    truncated = write_token_file(tmp_path / "truncated.bin", np.arange(100))
    meta = json.loads(truncated.with_suffix(".json").read_text())
    truncated.with_suffix(".json").write_text(json.dumps({**meta, "tokens": 200}))
    with pytest.raises(DataError, match="truncated or overwritten"):
        TokenDataset(truncated)
    empty = write_token_file(tmp_path / "empty.bin", [])
    with pytest.raises(DataError, match="holds no tokens"):
        TokenDataset(empty)


def test_window_bounds(tmp_path, write_token_file):
    dataset = TokenDataset(write_token_file(tmp_path / "train.bin", np.arange(12)))
    with pytest.raises(DataError, match="seq_len is 0: use a positive sequence length"):
        dataset.num_instances(0)
    assert dataset.num_instances(3) == 3
    with pytest.raises(IndexError, match="instance -1 out of range"):
        dataset.instance(-1, 3)


def test_a_folder_without_train_bin_says_the_token_file_is_missing(tmp_path):
    with pytest.raises(DataError, match=r"train.bin does not exist: ") as err:
        open_token_dataset(tmp_path)
    assert "heldout-fraction" not in str(err.value)


def test_a_sidecar_that_is_not_an_object_is_unreadable(tmp_path, write_token_file):
    path = write_token_file(tmp_path / "train.bin", np.arange(12))
    path.with_suffix(".json").write_text("[1, 2]")
    with pytest.raises(DataError, match="train.json is unreadable"):
        TokenDataset(path)


def test_another_tokenizer_names_a_token_file_not_named_train_or_heldout(tmp_path, write_token_file):
    from optimus.data.dataset import check_same_tokenizer

    dataset = TokenDataset(write_token_file(tmp_path / "mine.bin", np.arange(12)))  # tokenizer_sha256 "test"
    with pytest.raises(DataError, match=f"^{tmp_path / 'mine.bin'} was tokenized with another tokenizer"):
        check_same_tokenizer(dataset, "olmoe")
