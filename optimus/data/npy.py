"""Pre-tokenized OLMo/Dolma token files, as AI2 distributes OLMoE-mix-0924, read where they lie.

Despite the `.npy` suffix these files have no NumPy header and no sidecar: each is a flat array of
token ids (uint16 or uint32) with EOS between documents. OLMo's MemMapDataset (olmo/data/
memmap_dataset.py) reads instance i of a file as the bytes from i * itemsize * chunk_size, counted
from byte 0, with the dtype from its config, and never lets an instance cross into the next file.
We read them the same way (a seek and a read per instance, no map kept open), and also accept real `.npy` files (their magic bytes say so; the
header then gives the dtype). Our instances are seq_len + 1 tokens, as for our own token files.

Instances never span two files (as in OLMo), so a file shorter than seq_len + 1 tokens adds none.
"""

from __future__ import annotations

import glob as globbing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from optimus.data.errors import DataError

NPY_MAGIC = b"\x93NUMPY"
# Tokens read from the start, middle and end of each file to check ids against the vocabulary:
# enough to catch a wrong dtype or a foreign tokenizer, cheap enough for thousands of files.
CHECK_TOKENS_PER_PLACE = 4096


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id (< vocab_size) fits in 16 bits, else uint32 (OLMo's rule)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def expand_glob(pattern: str) -> list[Path]:
    """The files `pattern` matches, sorted (so every machine reads them in the same order)."""
    path = Path(pattern).expanduser()
    if path.is_file():
        return [path]
    matches = sorted(Path(p) for p in globbing.glob(str(path), recursive=True) if Path(p).is_file())
    if not matches:
        raise DataError(f"no files match {pattern!r}: check the path of the token files (and quote the glob)")
    return matches


@dataclass(frozen=True)
class _TokenFile:
    """Where one file's ids are: `path`, from byte `offset` (0, or past a .npy header), `count` ids of `dtype`."""

    path: Path
    offset: int
    count: int
    dtype: np.dtype

    def read(self, start: int, count: int) -> np.ndarray:
        """Ids start .. start+count-1, read with one open/seek/read (no map is kept: a mix has thousands of files)."""
        count = max(0, min(count, self.count - start))
        return np.fromfile(self.path, dtype=self.dtype, count=count, offset=self.offset + start * self.dtype.itemsize)


def _describe(path: Path, dtype: np.dtype) -> _TokenFile:
    """Find one file's ids: a real .npy through its header, anything else as raw ids of `dtype`."""
    with open(path, "rb") as f:
        has_header = f.read(len(NPY_MAGIC)) == NPY_MAGIC
    if has_header:
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as error:
            raise DataError(f"{path} has a .npy header but cannot be read ({error}): re-create the file") from None
        if tokens.ndim != 1 or tokens.dtype.kind != "u":
            raise DataError(
                f"{path} holds a {tokens.dtype} array of shape {tokens.shape}: token files must be flat unsigned ids"
            )
        described = _TokenFile(path, int(tokens.offset), len(tokens), tokens.dtype)
        del tokens  # releases the map and its file descriptor
        return described
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(
            f"{path} holds {size} bytes, not a whole number of {dtype.name} tokens "
            "(truncated, or another dtype): re-copy the file or set the source's dtype"
        )
    return _TokenFile(path, 0, size // dtype.itemsize, dtype)


def _check_ids(file: _TokenFile, vocab_size: int, dtype_was_given: bool) -> None:
    """Look at a few thousand ids from three places; refuse ids outside the vocabulary or a wrong dtype."""
    n, path = file.count, file.path
    places = sorted({0, max(0, n // 2 - CHECK_TOKENS_PER_PLACE // 2), max(0, n - CHECK_TOKENS_PER_PLACE)})
    sample = np.concatenate([file.read(p, CHECK_TOKENS_PER_PLACE) for p in places])
    if not len(sample):
        return
    if sample.max() >= vocab_size:
        raise DataError(
            f"{path} holds token id {int(sample.max())}, beyond the vocabulary of {vocab_size}: "
            "set the source's dtype (uint16 or uint32) to match the files, or use the tokenizer they were made with"
        )
    # uint32 ids read as uint16 come out as (id, 0) pairs: every odd position is zero. Real text never does that.
    if file.dtype == np.uint16 and not dtype_was_given and len(sample) >= 64 and not sample[1::2].any():
        raise DataError(f"{path} looks like uint32 token ids (every second uint16 is zero): set the source's dtype: uint32")


class TokenFiles:
    """The token files a glob matches, as one dataset of fixed-length instances (same interface as TokenDataset)."""

    def __init__(self, pattern: str, vocab_size: int, eos_id: int, dtype: str | None = None):
        """Find and map the files, check their sizes and a sample of ids against `vocab_size`."""
        self.path = pattern
        self.dtype = np.dtype(dtype) if dtype else dtype_for_vocab(vocab_size)
        self.files = expand_glob(pattern)
        self._eos_id = eos_id
        self._files = [_describe(path, self.dtype) for path in self.files]
        for file in self._files:
            _check_ids(file, vocab_size, dtype_was_given=dtype is not None)
        self._init_args = (pattern, vocab_size, eos_id, dtype)
        self._offsets: dict[int, np.ndarray] = {}

    @property
    def num_tokens(self) -> int:
        """Tokens in all files together."""
        return sum(file.count for file in self._files)

    @property
    def eos_id(self) -> int:
        """The end-of-document id (from the source's config or the tokenizer)."""
        return self._eos_id

    @property
    def tokenizer_sha256(self) -> None:
        """Unknown: these files carry no record of their tokenizer (the id check stands in for it)."""
        return None

    def _instance_offsets(self, seq_len: int) -> np.ndarray:
        """Cumulative instance counts per file: file k holds instances offsets[k] .. offsets[k+1]-1."""
        if seq_len not in self._offsets:
            counts = [file.count // (seq_len + 1) for file in self._files]
            self._offsets[seq_len] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return self._offsets[seq_len]

    def num_instances(self, seq_len: int) -> int:
        """How many non-overlapping windows of seq_len + 1 tokens the files hold (at least 1)."""
        if seq_len < 1:
            raise DataError(f"seq_len is {seq_len}: use a positive sequence length")
        count = int(self._instance_offsets(seq_len)[-1])
        if count == 0:
            raise DataError(
                f"the files of {self.path} hold {self.num_tokens} tokens, no file at least seq_len + 1 = "
                f"{seq_len + 1}: use a shorter sequence length or more data"
            )
        return count

    def instance(self, index: int, seq_len: int) -> np.ndarray:
        """Window `index` as int64 tokens of shape [seq_len + 1], counted across the files in order."""
        offsets = self._instance_offsets(seq_len)
        if not 0 <= index < offsets[-1]:
            raise IndexError(f"instance {index} out of range: {self.path} has {offsets[-1]} of length {seq_len}")
        k = int(np.searchsorted(offsets, index, side="right")) - 1
        start = (index - int(offsets[k])) * (seq_len + 1)
        return self._files[k].read(start, seq_len + 1).astype(np.int64)

    def document_ends(self) -> np.ndarray:
        """Positions of the EOS tokens across the concatenated files (scans every file once)."""
        ends, base = [], 0
        for file in self._files:
            ends.append(np.flatnonzero(file.read(0, file.count) == self._eos_id) + base)
            base += file.count
        return np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)

    def __getstate__(self) -> dict:
        # Send the arguments, not the per-file table: the other side re-checks the files it will read.
        return {"args": self._init_args}

    def __setstate__(self, state: dict) -> None:
        self.__init__(*state["args"])

    def __repr__(self) -> str:
        return f"TokenFiles({self.path!r}, files={len(self.files)}, tokens={self.num_tokens}, dtype={self.dtype.name})"
