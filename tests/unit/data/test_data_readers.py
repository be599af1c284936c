"""Input formats and input expansion (optimus/data/readers.py)."""

from __future__ import annotations

import gzip
import json

import pytest

from optimus.data.errors import DataError
from optimus.data.readers import expand_inputs, read_documents

DOCS = ["The Constitution of the United States.", "We the People, in Order to form a more perfect Union,"]


def _jsonl_bytes(docs) -> bytes:
    return "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def _write(tmp_path, name: str, docs=DOCS):
    """Write `docs` to tmp_path/name in the format its extension names."""
    path = tmp_path / name
    if name.endswith(".txt"):
        path.write_text(docs[0], encoding="utf-8")
    elif name.endswith(".jsonl"):
        path.write_bytes(_jsonl_bytes(docs))
    elif name.endswith(".jsonl.gz"):
        path.write_bytes(gzip.compress(_jsonl_bytes(docs)))
    elif name.endswith(".jsonl.zst"):
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(docs)))
    elif name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path)
    return path


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet"])
def test_each_record_format_yields_the_text_field(tmp_path, name):
    assert list(read_documents(_write(tmp_path, name))) == DOCS


def test_txt_file_is_one_document(tmp_path):
    text = "line one\nline two\n"
    (tmp_path / "doc.txt").write_text(text)
    assert list(read_documents(tmp_path / "doc.txt")) == [text]


def test_blank_jsonl_lines_are_skipped(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n\n   \n{"text": "y"}\n')
    assert list(read_documents(tmp_path / "a.jsonl")) == ["x", "y"]


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "broken\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON"):
        list(read_documents(path))
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r'bad\.jsonl:2: no string field "text"'):
        list(read_documents(path))


def test_unreadable_files_raise_data_error(tmp_path):
    (tmp_path / "a.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match="unsupported file type"):
        list(read_documents(tmp_path / "a.csv"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        list(read_documents(tmp_path / "latin1.txt"))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(DOCS * 50))[:60])
    with pytest.raises(DataError, match="cannot decompress"):
        list(read_documents(tmp_path / "cut.jsonl.gz"))
    (tmp_path / "junk.jsonl.zst").write_bytes(b"definitely not zstd")
    with pytest.raises(DataError, match="cannot decompress"):
        list(read_documents(tmp_path / "junk.jsonl.zst"))
    (tmp_path / "junk.parquet").write_bytes(b"definitely not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        list(read_documents(tmp_path / "junk.parquet"))


def test_parquet_without_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match='no "text" column'):
        list(read_documents(tmp_path / "a.parquet"))


def test_expand_inputs_globs_directories_and_order(tmp_path):
    for name in ["b.jsonl", "a.jsonl", "c.txt", "notes.md"]:
        (tmp_path / name).write_text('{"text": "x"}\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.parquet").write_bytes(b"")
    assert [p.name for p in expand_inputs([str(tmp_path / "*.jsonl")])] == ["a.jsonl", "b.jsonl"]
    assert [p.name for p in expand_inputs([str(tmp_path)])] == ["a.jsonl", "b.jsonl", "c.txt", "d.parquet"]
    explicit_first = expand_inputs([str(tmp_path / "c.txt"), str(tmp_path / "*.jsonl"), str(tmp_path / "c.txt")])
    assert [p.name for p in explicit_first] == ["c.txt", "a.jsonl", "b.jsonl"]


def test_expand_inputs_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        expand_inputs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(DataError, match="no input files match"):
        expand_inputs([str(tmp_path / "*.jsonl")])
    with pytest.raises(DataError, match="no input files given"):
        expand_inputs([])


def test_a_zstd_file_decompressing_to_more_than_one_read_buffer_is_read_whole(tmp_path):
    docs = [f"document {i} " + "x" * 3000 for i in range(40)]  # 120 KB: chunks larger than a read's buffer
    path = _write(tmp_path, "big.jsonl.zst", docs)
    assert list(read_documents(path)) == docs


def test_expand_inputs_takes_a_single_path_and_upper_case_suffixes(tmp_path):
    from pathlib import Path

    (tmp_path / "SPEECH.TXT").write_text("hello")
    (tmp_path / "notes.md").write_text("skip")
    assert expand_inputs(tmp_path / "SPEECH.TXT") == [tmp_path / "SPEECH.TXT"]
    assert expand_inputs([str(tmp_path)]) == [Path(tmp_path / "SPEECH.TXT")]
