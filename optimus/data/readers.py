"""Raw text input: which files a list of paths/globs means, and the documents inside each file.

Supported: .txt (the whole file is one document), .jsonl / .jsonl.gz / .jsonl.zst (one JSON object
per line, document in its "text" field) and .parquet (a "text" column). Anything malformed raises
DataError naming the file (and line), because a silent skip would quietly change the data.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

from optimus.data.errors import DataError

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")


def is_supported_file(path: str | Path) -> bool:
    """Whether `path` has one of the extensions read_documents understands."""
    return str(path).lower().endswith(SUPPORTED_SUFFIXES)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Turn paths, directories and globs into a sorted, de-duplicated list of files.

    Order is the order of `inputs`, each one's matches sorted, so the token stream is the same on
    every machine. A directory means every supported file under it (recursively).
    """
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    if not inputs:
        raise DataError("no input files given: pass --input with a file, directory or quoted glob")
    files: list[Path] = []
    for spec in map(str, inputs):
        path = Path(spec).expanduser()
        if path.is_dir():
            matches = sorted(p for p in path.rglob("*") if p.is_file() and is_supported_file(p))
        elif path.is_file():
            matches = [path]
        elif glob.has_magic(spec):
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        else:
            raise DataError(f"input {spec} does not exist: check the path (quote globs so the shell leaves them alone)")
        if not matches:
            raise DataError(f"no input files match {spec!r}: use one of {', '.join(SUPPORTED_SUFFIXES)}")
        files.extend(matches)
    return list(dict.fromkeys(files))  # drop repeats, keep the first position


def read_documents(path: str | Path) -> Iterator[str]:
    """Yield the documents stored in one file (see the module docstring for the formats)."""
    path = Path(path)
    name = path.name.lower()
    if not path.is_file():
        raise DataError(f"input {path} does not exist: check the path")
    if name.endswith(".txt"):
        yield _read_text_file(path)
    elif name.endswith(_JSONL_SUFFIXES):
        yield from _read_jsonl(path)
    elif name.endswith(".parquet"):
        yield from _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type: convert it to one of {', '.join(SUPPORTED_SUFFIXES)}")


def _read_text_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (byte {error.start}): convert the file to UTF-8") from None


def _open_jsonl(path: Path) -> io.TextIOBase:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if name.endswith(".zst"):
        return io.TextIOWrapper(io.BufferedReader(_ZstdFrames(path)), encoding="utf-8")
    return open(path, encoding="utf-8")


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file of one or more frames; a truncated last frame is a DataError.

    zstandard's stream_reader ends quietly where a cut-off file ends, which would silently drop the
    rest of the data; here each frame is decompressed on its own and must reach its end.
    """

    def __init__(self, path: Path):
        super().__init__()
        self._path = path
        self._file = open(path, "rb")
        self._chunks = self._decompressed_chunks()
        self._pending = memoryview(b"")  # decompressed bytes not yet handed out (a view: slicing copies nothing)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            self._pending = memoryview(next(self._chunks, b""))
            if not self._pending:
                return 0
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def _decompressed_chunks(self) -> Iterator[bytes]:
        import zstandard  # only needed for .zst input

        decompressor = zstandard.ZstdDecompressor()
        frame = None  # the decompressor of the frame being read; a new one after each frame's end
        data = b""
        while True:
            if not data:
                data = self._file.read(1 << 16)
                if not data:
                    if frame is not None and not frame.eof:
                        raise DataError(f"{self._path} ends before its zstd frame does: the file is truncated; "
                                        "download or copy it again")
                    return
            if frame is None or frame.eof:
                frame = decompressor.decompressobj()
            output = frame.decompress(data)
            data = frame.unused_data if frame.eof else b""
            if output:
                yield output

    def close(self) -> None:
        self._file.close()
        super().close()


def _read_jsonl(path: Path) -> Iterator[str]:
    line_number = 0
    try:
        with _open_jsonl(path) as lines:
            for line_number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                yield _text_of_json_line(path, line_number, line)
    except UnicodeDecodeError:
        raise DataError(f"{path}:{line_number + 1}: not UTF-8 text: convert the file to UTF-8") from None
    except (OSError, EOFError) as error:  # truncated or corrupt gzip/zstd streams end up here
        raise DataError(f"{path}:{line_number + 1}: cannot decompress ({error}): re-create the file") from None
    except Exception as error:
        if type(error).__name__ == "ZstdError":
            raise DataError(f"{path}:{line_number + 1}: cannot decompress ({error}): re-create the file") from None
        raise


def _text_of_json_line(path: Path, line_number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(
            f"{path}:{line_number}: malformed JSON ({error.msg}): fix or remove the line; "
            'each line must be an object like {"text": "..."}'
        ) from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(
            f'{path}:{line_number}: no string field "text": each line must be an object like {{"text": "..."}}'
        )
    return text


def _read_parquet(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq  # only needed for parquet input

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for non-parquet bytes
        raise DataError(f"{path}: not a readable parquet file ({error}): re-create it") from None
    if "text" not in parquet.schema_arrow.names:
        raise DataError(f'{path}: no "text" column (columns: {", ".join(parquet.schema_arrow.names)}): rename it to "text"')
    text_type = parquet.schema_arrow.field("text").type
    if not _is_string_type(text_type):
        raise DataError(f'{path}: the "text" column holds {text_type}, not strings: store each document '
                        "as a string (decode bytes, convert numbers) and write the file again")
    row = 0
    for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is None:  # as in JSONL, a missing document is an error, not a silent skip
                raise DataError(f'{path}: row {row} (0-based) has a null "text": fill in or drop the rows without text')
            row += 1
            yield text


def _is_string_type(arrow_type) -> bool:
    """Whether a parquet column of this arrow type reads as Python str (plain, large or dictionary-encoded)."""
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or (
        hasattr(pa.types, "is_string_view") and pa.types.is_string_view(arrow_type))
