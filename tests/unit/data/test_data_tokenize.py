"""Tokenizing real text into memmaps (optimus/data/tokenize.py, encode.py)."""

from __future__ import annotations

import argparse
import json
from itertools import islice

import numpy as np
import pytest

from optimus.data import tokenize as tokenize_module
from optimus.data.errors import DataError
from optimus.data.sources import iter_packaged_documents
from optimus.data.tokenize import (
    add_tokenize_arguments,
    is_heldout_document,
    prepare_packaged,
    tokenize_command,
    tokenize_documents,
    tokenize_files,
)

EOS = 50279


def _documents_of(tokens: np.ndarray) -> list[np.ndarray]:
    """Split a token stream at EOS (each document keeps no EOS)."""
    assert tokens[-1] == EOS
    ends = np.flatnonzero(tokens == EOS)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e] for s, e in zip(starts, ends)]


def test_sotu_round_trip_eos_dtype_and_sidecar(tmp_path, small_speeches, olmoe_tokenizer):
    summary = tokenize_files([str(p) for p in small_speeches], "olmoe", tmp_path, workers=1, progress=False)
    tokens = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    meta = json.loads((tmp_path / "train.json").read_text())
    assert meta["dtype"] == "uint16" and meta["eos_id"] == EOS and meta["vocab_size"] == 50280
    assert meta["tokens"] == len(tokens) == summary["tokens"] and meta["documents"] == 4 == summary["documents"]
    assert len(meta["tokenizer_sha256"]) == 64
    documents = _documents_of(tokens)
    assert len(documents) == 4  # EOS exactly once per document, at its end
    for path, ids in zip(small_speeches, documents):
        assert olmoe_tokenizer.decode(ids.tolist()) == path.read_text(encoding="utf-8")
    assert not (tmp_path / "heldout.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.bin", "train.json"]  # no temp files left


def test_every_input_format_gives_the_same_tokens(tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = list(islice(iter_packaged_documents("wiki-offline"), 3))
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "a.jsonl").write_bytes(lines)
    (inputs / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (inputs / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"text": texts}), inputs / "a.parquet")
    for i, text in enumerate(texts):
        (inputs / f"t{i}.txt").write_text(text)
    streams = {}
    for pattern in ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet", "t*.txt"]:
        output = tmp_path / pattern.replace("*", "_")
        tokenize_files([str(inputs / pattern)], "olmoe", output, workers=1, progress=False)
        streams[pattern] = np.fromfile(output / "train.bin", dtype=np.uint16)
    reference = streams.pop("a.jsonl")
    assert np.count_nonzero(reference == EOS) == 3
    for stream in streams.values():
        np.testing.assert_array_equal(stream, reference)


def test_output_is_identical_for_one_or_two_workers(tmp_path, small_speeches):
    inputs = [str(p) for p in small_speeches]
    for workers in (1, 2):
        # Small batches so the two workers really split the work and results must be re-ordered.
        tokenize_files(inputs, "olmoe", tmp_path / f"w{workers}", 0.25, workers, progress=False, batch_chars=2000)
    for name in ["train.bin", "heldout.bin"]:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()


def test_heldout_split_is_disjoint_whole_documents(sotu_tokenized, small_speeches, olmoe_tokenizer):
    train = _documents_of(np.fromfile(sotu_tokenized / "train.bin", dtype=np.uint16))
    heldout = _documents_of(np.fromfile(sotu_tokenized / "heldout.bin", dtype=np.uint16))
    assert (len(train), len(heldout)) == (3, 1)
    texts = [p.read_text(encoding="utf-8") for p in small_speeches]
    # Document 0 is held out (then every 1/f-th), the rest train, each exactly once.
    assert olmoe_tokenizer.decode(heldout[0].tolist()) == texts[0]
    assert [olmoe_tokenizer.decode(d.tolist()) for d in train] == texts[1:]
    meta = json.loads((sotu_tokenized / "heldout.json").read_text())
    assert meta["split"] == "heldout" and meta["documents"] == 1


def test_heldout_selection_is_even_and_never_empty():
    for fraction, n in [(0.02, 1000), (0.1, 7), (0.3, 10), (0.5, 2)]:
        chosen = [i for i in range(n) if is_heldout_document(i, fraction)]
        assert chosen[0] == 0 and len(chosen) == int(np.ceil(n * fraction - 1e-9))
    assert not any(is_heldout_document(i, 0.0) for i in range(10))


def test_no_tokens_and_all_heldout_raise_and_leave_nothing(tmp_path):
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    output = tmp_path / "out"
    with pytest.raises(DataError, match="produced no tokens"):
        tokenize_files([str(tmp_path / "empty.jsonl")], "olmoe", output, workers=1, progress=False)
    assert list(output.iterdir()) == []  # the temporary file was removed
    (tmp_path / "one.txt").write_text("A single short document.")
    with pytest.raises(DataError, match="all 1 documents went to the held-out split"):
        tokenize_files([str(tmp_path / "one.txt")], "olmoe", output, heldout_fraction=0.5, workers=1, progress=False)
    with pytest.raises(DataError, match="heldout_fraction is 1.0"):
        tokenize_files([str(tmp_path / "one.txt")], "olmoe", output, heldout_fraction=1.0, progress=False)


def test_a_failed_first_tokenization_leaves_no_folder_behind(tmp_path, capsys):
    """`optimus tokenize` into a new folder that then fails left the empty folder, which looks like a result."""
    from optimus.cli import main

    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    assert main(["tokenize", "--input", str(tmp_path / "empty.jsonl"), "--output", str(tmp_path / "new")]) == 2
    assert "produced no tokens" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()  # a folder the user made is theirs: kept
    assert main(["tokenize", "--input", str(tmp_path / "empty.jsonl"), "--output", str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine").is_dir()


def test_a_split_discarded_on_a_full_disk_removes_its_temporary_file(tmp_path):
    """On a full disk closing the temporary file fails too (its buffer cannot be flushed): the file is still
    removed, not left as .train.bin.PID.tmp."""
    import errno

    writer = tokenize_module._SplitWriter(tmp_path, "train")
    real_close = writer.file.close

    def close_on_a_full_disk():
        real_close()
        raise OSError(errno.ENOSPC, "No space left on device")

    writer.file.close = close_on_a_full_disk
    writer.discard()
    assert list(tmp_path.iterdir()) == []


def test_bad_line_midway_raises_and_keeps_the_previous_output(tmp_path):
    (tmp_path / "good.jsonl").write_text('{"text": "first version"}\n')
    tokenize_files([str(tmp_path / "good.jsonl")], "olmoe", tmp_path / "out", workers=2, progress=False)
    before = (tmp_path / "out" / "train.bin").read_bytes()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        tokenize_files([str(tmp_path / "bad.jsonl")], "olmoe", tmp_path / "out", workers=2, progress=False)
    assert (tmp_path / "out" / "train.bin").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train.bin", "train.json"]


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70_000)] + ["</s>"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "big.json"))
    documents = ["w1 w69999", "w65536"]
    tokenize_documents(documents, str(tmp_path / "big.json"), tmp_path / "out", workers=1, progress=False)
    meta = json.loads((tmp_path / "out" / "train.json").read_text())
    assert meta["dtype"] == "uint32" and meta["eos_id"] == 70_000
    tokens = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint32)
    assert tokens.tolist() == [1, 69999, 70_000, 65536, 70_000]


def test_tokenize_command_and_its_arguments(tmp_path, small_speeches, capsys):
    parser = argparse.ArgumentParser()
    add_tokenize_arguments(parser)
    args = parser.parse_args(
        ["--input", str(small_speeches[0]), str(small_speeches[1]), "--output", str(tmp_path), "--workers", "1",
         "--heldout-fraction", "0.5", "--no-progress"]
    )  # fmt: skip
    assert args.tokenizer == "olmoe" and args.heldout_fraction == 0.5 and len(args.input) == 2
    assert tokenize_command(args) == 0
    summary = capsys.readouterr().out
    assert "Tokenized 2 documents from 2 files" in summary and "tokens/s" in summary
    assert "train.bin" in summary and "heldout.bin" in summary

    # again into the same folder: refused (a run may read it; without a held-out split heldout.bin would go)
    args.heldout_fraction = 0.0
    with pytest.raises(DataError, match="already holds tokenized data"):
        tokenize_command(args)
    assert (tmp_path / "heldout.bin").exists()
    args.overwrite = True
    assert tokenize_command(args) == 0 and not (tmp_path / "heldout.bin").exists()


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_fewer_than_one_worker_is_refused_before_anything_is_written(workers, tmp_path, small_speeches):
    parser = argparse.ArgumentParser()
    add_tokenize_arguments(parser)
    args = parser.parse_args(["--input", str(small_speeches[0]), "--output", str(tmp_path / "out"), "--workers",
                              workers, "--no-progress"])
    with pytest.raises(DataError, match=f"--workers {workers}: must be at least 1"):
        tokenize_command(args)
    assert not (tmp_path / "out").exists()


def test_prepare_packaged_builds_once_then_reuses(tmp_path, monkeypatch):
    three_docs = lambda name: islice(iter_packaged_documents(name), 3)  # noqa: E731 - keeps the test fast
    monkeypatch.setattr(tokenize_module, "iter_packaged_documents", three_docs)
    train, heldout = prepare_packaged("sotu", "olmoe", tmp_path, 0.34, workers=1, progress=False)
    assert train.parent.name.startswith("sotu-9ad33b4b-h0.34") and train.parent.parent == tmp_path
    assert json.loads(train.with_suffix(".json").read_text())["documents"] == 2
    assert json.loads(heldout.with_suffix(".json").read_text())["documents"] == 1
    built = train.read_bytes()

    def must_not_run(name):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(tokenize_module, "iter_packaged_documents", must_not_run)
    assert prepare_packaged("sotu", "olmoe", tmp_path, 0.34, workers=1, progress=False) == (train, heldout)
    # A truncated cache (e.g. a crash or a full disk) is detected and rebuilt.
    train.write_bytes(built[:10])
    monkeypatch.setattr(tokenize_module, "iter_packaged_documents", three_docs)
    prepare_packaged("sotu", "olmoe", tmp_path, 0.34, workers=1, progress=False)
    assert train.read_bytes() == built
    assert [p.name for p in tmp_path.iterdir()] == [train.parent.name]  # no temporary directories left
