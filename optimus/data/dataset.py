"""A read-only view of one tokenized file as fixed-length training instances.

An instance is a window of seq_len + 1 consecutive tokens cut from the file's token stream
(documents concatenated, EOS between them): the model reads window[:-1] and predicts
window[1:]. Windows do not overlap and ignore document boundaries, as in OLMo; the EOS tokens
inside a window tell attention where documents start if it masks across them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from optimus.data.errors import DataError
from optimus.data.sources import file_sha256, resolve_tokenizer_path

_TOKENIZE_HINT = "create it with `optimus tokenize --input FILES --output DIR`"
TOKEN_DTYPES = ("uint16", "uint32")  # what tokenize.token_dtype writes


class TokenDataset:
    """Token ids of one `.bin` file (or a directory's `train.bin`), memory-mapped read-only."""

    def __init__(self, path: str | Path):
        """Open `path`, a `.bin` file with its `.json` sidecar, or a directory holding train.bin."""
        path = Path(path)
        if path.is_dir():
            path = path / "train.bin"
        if not path.is_file():
            raise DataError(f"token file {path} does not exist: {_TOKENIZE_HINT}")
        sidecar = path.with_suffix(".json")
        if not sidecar.is_file():
            raise DataError(f"{path} has no sidecar {sidecar.name} (incomplete or not ours): {_TOKENIZE_HINT}")
        try:
            meta = json.loads(sidecar.read_text())
            dtype_name = meta["dtype"]
            expected_tokens = int(meta["tokens"])
        except (ValueError, KeyError, TypeError) as error:
            raise DataError(f"{sidecar} is unreadable ({error}): re-run `optimus tokenize` for this data") from None
        if dtype_name not in TOKEN_DTYPES:  # checked before numpy sees it: "object" would crash the memmap
            raise DataError(f"{sidecar} gives dtype {dtype_name!r}, not one `optimus tokenize` writes "
                            f"({' or '.join(TOKEN_DTYPES)}): re-run `optimus tokenize` for this data")
        dtype = np.dtype(dtype_name)
        size = path.stat().st_size
        if size != expected_tokens * dtype.itemsize:
            raise DataError(
                f"{path} holds {size} bytes but its sidecar says {expected_tokens} {dtype.name} tokens "
                "(truncated or overwritten): re-run `optimus tokenize` for this data"
            )
        if expected_tokens == 0:
            raise DataError(f"{path} holds no tokens: re-run `optimus tokenize` with more input")
        self.path = path
        self.meta = meta
        self.dtype = dtype
        self._tokens = np.memmap(path, dtype=dtype, mode="r")

    @property
    def num_tokens(self) -> int:
        """Tokens in the file, EOS tokens included."""
        return len(self._tokens)

    @property
    def eos_id(self) -> int | None:
        """The end-of-document id recorded by the tokenizer run."""
        return self.meta.get("eos_id")

    @property
    def tokenizer_sha256(self) -> str | None:
        """SHA-256 of the tokenizer.json that produced the file (to refuse mixing tokenizers)."""
        return self.meta.get("tokenizer_sha256")

    def num_instances(self, seq_len: int) -> int:
        """How many non-overlapping windows of seq_len + 1 tokens the file holds (at least 1)."""
        if seq_len < 1:
            raise DataError(f"seq_len is {seq_len}: use a positive sequence length")
        count = self.num_tokens // (seq_len + 1)
        if count == 0:
            raise DataError(
                f"{self.path} has {self.num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
                "use a shorter sequence length or tokenize more text (or a larger heldout_fraction)"
            )
        return count

    def instance(self, index: int, seq_len: int) -> np.ndarray:
        """Window `index` as int64 tokens of shape [seq_len + 1]: inputs w[:-1], labels w[1:]."""
        count = self.num_instances(seq_len)
        if not 0 <= index < count:
            raise IndexError(f"instance {index} out of range: {self.path} has {count} of length {seq_len}")
        start = index * (seq_len + 1)
        return np.asarray(self._tokens[start : start + seq_len + 1], dtype=np.int64)

    def document_ends(self) -> np.ndarray:
        """Positions of the EOS tokens, i.e. where each document ends (scans the file once)."""
        return np.flatnonzero(np.asarray(self._tokens) == self.eos_id)

    def __getstate__(self) -> dict:
        # Pickling a memmap copies the whole array; send the path and re-map on the other side.
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, tokens={self.num_tokens}, dtype={self.dtype.name})"


def open_token_dataset(path: str | Path, split: str = "train", tokenizer: str | None = None) -> TokenDataset:
    """Open tokenized data: a directory means its `<split>.bin`; a `.bin` file is used as given.

    With `tokenizer` (a run's data.tokenizer), data recorded as made with another tokenizer is refused.
    """
    if split not in ("train", "heldout"):
        raise DataError(f"unknown split {split!r}: use 'train' or 'heldout'")
    path = Path(path)
    if path.is_dir():
        path = path / f"{split}.bin"
        if split == "heldout" and not path.is_file():
            raise DataError(
                f"{path} does not exist: re-run `optimus tokenize` with --heldout-fraction > 0 (e.g. 0.02)"
            )
    dataset = TokenDataset(path)
    if tokenizer is not None:
        check_same_tokenizer(dataset, tokenizer)
    return dataset


def check_same_tokenizer(dataset: TokenDataset, tokenizer: str) -> None:
    """Raise DataError when `dataset` was tokenized with another tokenizer than `tokenizer` (a data.tokenizer spec).

    The token ids of one tokenizer mean other words to another, so training or evaluating on them gives
    a wrong result without any error. Data whose sidecar predates tokenizer_sha256 is accepted.
    """
    recorded = dataset.tokenizer_sha256
    if not recorded:
        return
    wanted = file_sha256(resolve_tokenizer_path(tokenizer))  # as tokenize.py records it (sources.tokenizer_info)
    if recorded != wanted:
        folder = dataset.path.parent if dataset.path.name in ("train.bin", "heldout.bin") else dataset.path
        made_with = dataset.meta.get("tokenizer") or "another tokenizer"
        raise DataError(
            f"{folder} was tokenized with {made_with} (sha256 {recorded[:12]}), not with this run's data.tokenizer "
            f"{tokenizer} (sha256 {wanted[:12]}): tokenize it again with `optimus tokenize --tokenizer {tokenizer}`, "
            f"or set data.tokenizer={made_with}"
        )


def has_heldout_split(path: str | Path) -> bool:
    """Whether open_token_dataset(path, split="heldout") has a split to open: a folder holding heldout.bin or
    heldout.json (either one means the split is meant to be there), or a `.bin` file (used as given)."""
    path = Path(path)
    if not path.is_dir():
        return True
    return (path / "heldout.bin").exists() or (path / "heldout.json").exists()
