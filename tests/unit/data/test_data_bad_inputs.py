"""Damaged or mismatched input is refused with one DataError naming the file, never read as something else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from optimus.data.dataset import TokenDataset, open_token_dataset
from optimus.data.errors import DataError
from optimus.data.readers import read_documents
from optimus.data.sources import resolve_tokenizer_path
from optimus.data.tokenize import tokenize_documents, tokenize_files

DOCS = [f"Document number {i} says something about the Union." for i in range(40)]


def _zst(tmp_path: Path, name: str, frames: list[bytes]) -> Path:
    import zstandard

    path = tmp_path / name
    path.write_bytes(b"".join(zstandard.ZstdCompressor().compress(frame) for frame in frames))
    return path


def _jsonl(docs) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


# ------------------------------------------------------------------------------------------ zstd


def test_whole_zstd_files_of_one_or_more_frames_read_fully(tmp_path):
    assert list(read_documents(_zst(tmp_path, "one.jsonl.zst", [_jsonl(DOCS)]))) == DOCS
    assert list(read_documents(_zst(tmp_path, "two.jsonl.zst", [_jsonl(DOCS[:5]), _jsonl(DOCS[5:])]))) == DOCS


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.99])
def test_truncated_zstd_file_is_refused_naming_it(tmp_path, keep):
    whole = _zst(tmp_path, "whole.jsonl.zst", [_jsonl(DOCS * 20)]).read_bytes()
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(whole[: int(len(whole) * keep)])
    with pytest.raises(DataError, match=r"cut\.jsonl\.zst ends before its zstd frame does: the file is truncated"):
        list(read_documents(cut))


def test_truncated_second_zstd_frame_is_refused(tmp_path):
    whole = _zst(tmp_path, "whole.jsonl.zst", [_jsonl(DOCS[:5]), _jsonl(DOCS[5:])]).read_bytes()
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(whole[:-4])
    with pytest.raises(DataError, match="truncated"):
        list(read_documents(cut))


def test_tokenize_refuses_a_truncated_zstd_input_beside_a_good_one(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_bytes(_jsonl(DOCS))
    whole = _zst(tmp_path, "whole.jsonl.zst", [_jsonl(DOCS)]).read_bytes()
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match="cut.jsonl.zst ends before its zstd frame does"):
        tokenize_files([str(good), str(cut)], "olmoe", tmp_path / "out", workers=1, progress=False)
    assert not (tmp_path / "out" / "train.bin").exists()


# --------------------------------------------------------------------------------------- parquet


def _parquet(tmp_path: Path, column) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": column}), path)
    return path


@pytest.mark.parametrize("column, type_name", [([1, 2, 3], "int64"), ([b"\x00a", b"b"], "binary")])
def test_parquet_text_column_that_is_not_strings_is_refused(tmp_path, column, type_name):
    with pytest.raises(DataError, match=rf'docs\.parquet: the "text" column holds {type_name}, not strings'):
        list(read_documents(_parquet(tmp_path, column)))


def test_parquet_null_text_is_refused_like_jsonl(tmp_path):
    with pytest.raises(DataError, match=r'docs\.parquet: row 1 \(0-based\) has a null "text"'):
        list(read_documents(_parquet(tmp_path, ["x", None, "y"])))
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n{"text": null}\n')
    with pytest.raises(DataError, match='a.jsonl:2: no string field "text"'):
        list(read_documents(tmp_path / "a.jsonl"))


def test_parquet_dictionary_encoded_strings_are_read(tmp_path):
    import pyarrow as pa

    column = pa.array(["x", "y", "x"]).dictionary_encode()
    assert list(read_documents(_parquet(tmp_path, column))) == ["x", "y", "x"]


# ------------------------------------------------------------------------------- sidecar dtype


@pytest.mark.parametrize("dtype", ["uint8", "object", "float32", "int64", "banana", ["uint16"]])
def test_sidecar_dtype_other_than_what_tokenize_writes_is_refused(tmp_path, write_token_file, dtype):
    path = write_token_file(tmp_path / "train.bin", np.arange(64))
    meta = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**meta, "dtype": dtype}))
    with pytest.raises(DataError, match=r"train\.json gives dtype .*not one `optimus tokenize` writes \(uint16 or "
                                        r"uint32\)"):
        TokenDataset(path)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_sidecar_dtypes_tokenize_writes_are_accepted(tmp_path, write_token_file, dtype):
    assert TokenDataset(write_token_file(tmp_path / "train.bin", np.arange(64), dtype=dtype)).dtype == np.dtype(dtype)


def test_a_token_file_longer_than_its_sidecar_says_is_refused(tmp_path, write_token_file):
    """Extra bytes after the counted tokens mean the .bin was overwritten or appended to: refuse, do not train on it."""
    path = write_token_file(tmp_path / "train.bin", np.arange(64))
    meta = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**meta, "tokens": 32}))
    with pytest.raises(DataError, match=r"train\.bin holds 128 bytes but its sidecar says 32 uint16 tokens"):
        TokenDataset(path)


# -------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """A tokenizer.json with the OLMoE vocabulary but other bytes (so another sha256)."""
    path = tmp_path_factory.mktemp("other-tokenizer") / "tokenizer.json"
    path.write_text(resolve_tokenizer_path("olmoe").read_text() + "\n")
    return path


@pytest.fixture(scope="module")
def foreign_data(tmp_path_factory, other_tokenizer) -> Path:
    out = tmp_path_factory.mktemp("foreign-data")
    tokenize_documents(DOCS * 10, str(other_tokenizer), out, heldout_fraction=0.2, workers=1, progress=False)
    return out


def _config(token_dir: Path, tokenizer: str = "olmoe"):
    from optimus.config import build_config

    return build_config({"model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_experts": 0, "ffn_hidden": 64},
                         "train": {"seq_len": 16, "global_batch_size": 4},
                         "data": {"tokenizer": tokenizer, "sources": [{"path": str(token_dir)}]}})


def test_training_refuses_data_made_with_another_tokenizer(foreign_data, other_tokenizer):
    from optimus.data.build import build_training_data

    with pytest.raises(DataError) as caught:
        build_training_data(_config(foreign_data))
    message = str(caught.value)
    assert "\n" not in message
    assert f"{foreign_data} was tokenized with {other_tokenizer}" in message
    assert "this run's data.tokenizer olmoe" in message
    assert "tokenize it again with `optimus tokenize --tokenizer olmoe`" in message
    assert f"set data.tokenizer={other_tokenizer}" in message


def test_training_accepts_data_made_with_the_runs_tokenizer(foreign_data, other_tokenizer):
    from optimus.data.build import build_training_data

    assert len(build_training_data(_config(foreign_data, str(other_tokenizer))).heldout) == 1


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_opening_a_folder_for_a_run_refuses_another_tokenizer(foreign_data, split):
    """What `optimus eval --data` needs: the folder opened with the run's data.tokenizer."""
    with pytest.raises(DataError, match="was tokenized with"):
        open_token_dataset(foreign_data, split=split, tokenizer="olmoe")
    assert open_token_dataset(foreign_data, split=split).num_tokens > 0  # without a tokenizer: no check


def test_data_without_a_recorded_tokenizer_is_accepted(tmp_path, foreign_data):
    from optimus.data.build import build_training_data

    old = tmp_path / "old"
    shutil.copytree(foreign_data, old)
    for sidecar in old.glob("*.json"):
        meta = json.loads(sidecar.read_text())
        del meta["tokenizer_sha256"]
        sidecar.write_text(json.dumps(meta))
    assert len(build_training_data(_config(old)).heldout) == 1


# ------------------------------------------------------------------------------ held-out split


@pytest.fixture
def olmoe_data(tmp_path) -> Path:
    out = tmp_path / "data"
    tokenize_documents(DOCS * 10, "olmoe", out, heldout_fraction=0.2, workers=1, progress=False)
    return out


@pytest.mark.parametrize("damage, fragment", [
    (lambda d: (d / "heldout.json").write_text("{trunc"), r"heldout\.json is unreadable"),
    (lambda d: (d / "heldout.json").unlink(), r"heldout\.bin has no sidecar heldout\.json"),
    (lambda d: (d / "heldout.bin").unlink(), r"heldout\.bin does not exist"),
    (lambda d: (d / "heldout.bin").write_bytes(b"\x00\x01\x02"), r"heldout\.bin holds 3 bytes"),
])  # fmt: skip
def test_a_present_but_unreadable_heldout_split_is_refused(olmoe_data, damage, fragment):
    from optimus.data.build import build_training_data

    damage(olmoe_data)
    with pytest.raises(DataError, match=fragment):
        build_training_data(_config(olmoe_data))


def test_a_folder_without_any_heldout_split_trains_without_evaluation(olmoe_data):
    from optimus.data.build import build_training_data

    (olmoe_data / "heldout.json").unlink()
    (olmoe_data / "heldout.bin").unlink()
    assert build_training_data(_config(olmoe_data)).heldout == []
