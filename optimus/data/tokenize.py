"""Raw text -> flat token memmaps in OLMo's format, plus the `optimus tokenize` verb.

On disk: `train.bin` is a headerless array of token ids (uint16, or uint32 when an id does not fit
in 16 bits) with EOS appended after every document; `train.json` beside it says how to read it
(dtype, tokens, documents, tokenizer_sha256, eos_id, vocab_size). `heldout.bin/.json` holds the
documents set aside for evaluation. Data is written to temporary files that are renamed into
place, and the sidecar is written last: a crash never leaves a file that looks complete.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from itertools import chain
from pathlib import Path

import numpy as np

from optimus.atomic_write import write_text_whole
from optimus.data.encode import batched_documents, encoded_batches, worker_pool
from optimus.data.errors import DataError
from optimus.data.readers import expand_inputs, read_documents
from optimus.data.sources import (
    iter_packaged_documents,
    packaged_corpus_fingerprint,
    tokenizer_info,
)

__all__ = [
    "add_tokenize_arguments",
    "prepare_packaged",
    "read_documents",
    "tokenize_command",
    "tokenize_documents",
    "tokenize_files",
]

FORMAT_VERSION = 1
SPLITS = ("train", "heldout")
DEFAULT_BATCH_CHARS = 1 << 20  # ~1 MB of text per worker task: big enough to amortize pickling


def default_workers() -> int:
    """Worker processes to use when none is given: the CPUs this process may run on, at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 16))


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits (OLMo's format), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_heldout_document(index: int, heldout_fraction: float) -> bool:
    """Whether document `index` (0-based, in input order) belongs to the held-out split.

    Documents 0, 1/f, 2/f, ... are held out: exactly ceil(n*f) of n documents, spread evenly, at
    least one whenever f > 0, and independent of how the work was split among workers.
    """
    if heldout_fraction <= 0:
        return False
    return math.floor(index * heldout_fraction) != math.floor((index - 1) * heldout_fraction)


class _SplitWriter:
    """Appends tokens of one split to a temporary file; `commit` renames it and writes the sidecar."""

    def __init__(self, output_dir: Path, split: str):
        self.bin_path = output_dir / f"{split}.bin"
        self.meta_path = output_dir / f"{split}.json"
        # A hidden, per-process name: a reader globbing *.bin never sees it, and a concurrent
        # writer to the same directory cannot clobber it.
        self.temp_path = output_dir / f".{split}.bin.{os.getpid()}.tmp"
        self.file = open(self.temp_path, "wb")
        self.tokens = 0
        self.documents = 0

    def write(self, tokens: np.ndarray, documents: int) -> None:
        self.file.write(tokens.tobytes())
        self.tokens += len(tokens)
        self.documents += documents

    def commit(self, meta: dict) -> None:
        self.file.close()
        # Old sidecar first: between the two renames the split must look incomplete, not valid.
        self.meta_path.unlink(missing_ok=True)
        os.replace(self.temp_path, self.bin_path)
        _write_json_atomically(self.meta_path, {**meta, "tokens": self.tokens, "documents": self.documents})

    def discard(self) -> None:
        try:
            self.file.close()  # (flushing its buffer fails again on the full disk that ended the run)
        except OSError:
            pass
        finally:
            self.temp_path.unlink(missing_ok=True)


def _write_batch(
    writers: dict[str, _SplitWriter], tokens: np.ndarray, lengths: np.ndarray, first_index: int, heldout_fraction: float
) -> int:
    """Append one encoded batch, whole documents to train or heldout; returns the next document index."""
    if heldout_fraction == 0:  # the common case: one write per batch
        count = int(np.count_nonzero(lengths))
        writers["train"].write(tokens, documents=count)
        return first_index + count
    index = first_index
    for length, end in zip(lengths, np.cumsum(lengths)):
        if length == 0:  # an empty document has no tokens and no EOS
            continue
        split = "heldout" if is_heldout_document(index, heldout_fraction) else "train"
        writers[split].write(tokens[end - length : end], documents=1)
        index += 1
    return index


def _write_json_atomically(path: Path, content: dict) -> None:
    write_text_whole(path, json.dumps(content, indent=2) + "\n")


def _progress_bar(enabled: bool):
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        TextColumn("{task.fields[documents]:,} docs  {task.completed:,.0f} tokens  {task.fields[rate]:,.0f} tokens/s"),
        TimeElapsedColumn(),
        console=Console(stderr=True),  # stdout stays clean for the summary
        disable=not enabled,
        transient=True,
    )


def tokenize_documents(
    documents: Iterable[str],
    tokenizer: str,
    output_dir: str | Path,
    heldout_fraction: float = 0.0,
    workers: int | None = None,
    progress: bool = True,
    *,
    batch_chars: int = DEFAULT_BATCH_CHARS,
    extra_meta: dict | None = None,
) -> dict:
    """Tokenize a stream of documents into `output_dir/train.bin` (+ `heldout.bin` if f > 0).

    Returns a summary: documents, tokens, files written, seconds, tokens_per_s and per-split
    counts. The result does not depend on `workers` or `batch_chars`.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction is {heldout_fraction}: use a value in [0, 1), e.g. 0.02")
    workers = default_workers() if workers is None else max(1, int(workers))
    info = tokenizer_info(tokenizer)
    dtype = token_dtype(info["vocab_size"])
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    splits = SPLITS if heldout_fraction > 0 else ("train",)
    writers = {split: _SplitWriter(output_dir, split) for split in splits}
    started = time.perf_counter()
    try:
        # The pool is forked before the progress bar starts its refresh thread: forking while
        # another thread holds a lock (e.g. stderr's) can deadlock the children.
        with worker_pool(tokenizer, workers) as pool, _progress_bar(progress) as bar:
            task = bar.add_task("tokenizing", total=None, documents=0, rate=0.0)
            document_index = tokens_done = 0
            batches = batched_documents(documents, batch_chars)
            for tokens, lengths in encoded_batches(batches, pool, workers, tokenizer, info["eos_id"], dtype):
                document_index = _write_batch(writers, tokens, lengths, document_index, heldout_fraction)
                tokens_done += len(tokens)
                rate = tokens_done / max(time.perf_counter() - started, 1e-9)
                bar.update(task, completed=tokens_done, documents=document_index, rate=rate)
        if writers["train"].tokens == 0:
            if document_index == 0:
                raise DataError("the input produced no tokens (no documents, or only empty ones): check the input files")
            raise DataError(
                f"all {document_index} documents went to the held-out split: lower heldout_fraction or add documents"
            )
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "tokenizer": tokenizer,
        "tokenizer_sha256": info["sha256"],
        "eos_id": info["eos_id"],
        "pad_id": info["pad_id"],
        "vocab_size": info["vocab_size"],
        "heldout_fraction": heldout_fraction,
        **(extra_meta or {}),
    }
    for split, writer in writers.items():
        writer.commit({**meta, "split": split})
    if heldout_fraction == 0:
        # A heldout.bin left from an earlier run with f > 0 no longer matches this train.bin.
        for stale in ("heldout.json", "heldout.bin"):
            (output_dir / stale).unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    total_tokens = sum(writer.tokens for writer in writers.values())
    return {
        "documents": document_index,
        "tokens": total_tokens,
        "seconds": seconds,
        "tokens_per_s": total_tokens / max(seconds, 1e-9),
        "files": [str(writer.bin_path) for writer in writers.values()],
        "splits": {split: {"tokens": w.tokens, "documents": w.documents} for split, w in writers.items()},
        "dtype": dtype.name,
        "vocab_size": info["vocab_size"],
    }


def tokenize_files(
    inputs: list[str],
    tokenizer: str,
    output_dir: str | Path,
    heldout_fraction: float = 0.0,
    workers: int | None = None,
    progress: bool = True,
    *,
    batch_chars: int = DEFAULT_BATCH_CHARS,
) -> dict:
    """Tokenize the files named by `inputs` (paths, directories or globs) into `output_dir`.

    See tokenize_documents for the output and the returned summary (which also has "inputs",
    the number of input files). workers=None uses every available CPU.
    """
    files = expand_inputs(inputs)
    documents = chain.from_iterable(read_documents(path) for path in files)
    summary = tokenize_documents(
        documents,
        tokenizer,
        output_dir,
        heldout_fraction,
        workers,
        progress,
        batch_chars=batch_chars,
        # Capped so that a corpus of a million shards does not get a 100 MB sidecar.
        extra_meta={"input_count": len(files), "inputs": [str(path) for path in files[:1000]]},
    )
    return {**summary, "inputs": len(files)}


def _split_is_complete(output_dir: Path, split: str, expected: dict) -> bool:
    meta_path, bin_path = output_dir / f"{split}.json", output_dir / f"{split}.bin"
    try:
        meta = json.loads(meta_path.read_text())
        size_ok = bin_path.stat().st_size == meta["tokens"] * np.dtype(meta["dtype"]).itemsize
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return size_ok and all(meta.get(key) == value for key, value in expected.items())


def prepare_packaged(
    name: str,
    tokenizer: str,
    cache_dir: str | Path,
    heldout_fraction: float,
    workers: int | None = None,
    progress: bool = True,
) -> tuple[Path, Path]:
    """Tokenize packaged corpus `name` once into `cache_dir/<name>-<tokenizer sha8>-h<fraction>/`.

    Returns (train.bin, heldout.bin); heldout.bin does not exist when heldout_fraction is 0. A
    complete cache (sidecars present, sizes right, same tokenizer and corpus files) is reused.
    Safe against concurrent callers (e.g. several ranks): each builds in a private temporary
    directory that is renamed into place; whoever renames second uses the first one's result.
    """
    fingerprint = packaged_corpus_fingerprint(name)  # also validates `name`
    info = tokenizer_info(tokenizer)
    cache_dir = Path(cache_dir)
    target = cache_dir / f"{name}-{info['sha256'][:8]}-h{heldout_fraction:g}"
    expected = {"tokenizer_sha256": info["sha256"], "corpus_fingerprint": fingerprint}
    splits = SPLITS if heldout_fraction > 0 else ("train",)
    paths = (target / "train.bin", target / "heldout.bin")
    if all(_split_is_complete(target, split, expected) for split in splits):
        return paths
    # A private, hidden build directory (os.mkdir, unlike mkdtemp, honours the umask).
    building = cache_dir / f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        building.mkdir()
    except OSError as err:
        raise DataError(f"data.cache_dir {cache_dir} cannot hold the tokenized corpus ({err.strerror}: "
                        f"{err.filename}): set data.cache_dir to a folder this user can write") from None
    try:
        tokenize_documents(
            iter_packaged_documents(name),
            tokenizer,
            building,
            heldout_fraction,
            workers,
            progress,
            extra_meta={"corpus": name, "corpus_fingerprint": fingerprint},
        )
        if target.exists() and not all(_split_is_complete(target, split, expected) for split in splits):
            shutil.rmtree(target)  # stale or half-built: replace it
        try:
            os.rename(building, target)
        except OSError:
            if not all(_split_is_complete(target, split, expected) for split in splits):
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return paths


def add_tokenize_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `optimus tokenize` options to an argparse (sub)parser."""
    parser.add_argument(
        "--input", nargs="+", action="extend", required=True, metavar="PATH",
        help="files, directories or quoted globs: .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet",
    )  # fmt: skip
    parser.add_argument("--tokenizer", default="olmoe", help="'olmoe' or a path to a tokenizer.json (default: olmoe)")
    parser.add_argument("--output", required=True, help="directory for train.bin/.json (and heldout.bin/.json)")
    parser.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all CPUs)")
    parser.add_argument(
        "--heldout-fraction", dest="heldout_fraction", type=float, default=0.0,
        help="fraction of documents set aside in heldout.bin for evaluation (default: 0)",
    )  # fmt: skip
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the tokenized data --output already holds (refused without it)")


def tokenize_command(args: argparse.Namespace) -> int:
    """The `optimus tokenize` verb: tokenize args.input into args.output and print a summary."""
    workers = getattr(args, "workers", None)
    if workers is not None and workers < 1:  # tokenize_files would quietly run one process
        raise DataError(f"--workers {workers}: must be at least 1 (or left out for every CPU)")
    held = [name for name in ("train.bin", "heldout.bin") if (Path(args.output) / name).exists()]
    if held and not getattr(args, "overwrite", False):
        # a training run may be reading them; and a new train.bin without --heldout-fraction drops heldout.bin
        raise DataError(f"--output {args.output} already holds tokenized data ({', '.join(held)}): choose a new "
                        "folder, or pass --overwrite to replace it")
    summary = tokenize_files(
        args.input,
        getattr(args, "tokenizer", "olmoe"),
        args.output,
        heldout_fraction=getattr(args, "heldout_fraction", 0.0) or 0.0,
        workers=workers,
        progress=getattr(args, "progress", True),
    )
    splits = ", ".join(
        f"{path} ({summary['splits'][Path(path).stem]['tokens']:,} tokens, "
        f"{summary['splits'][Path(path).stem]['documents']:,} documents)"
        for path in summary["files"]
    )
    print(
        f"Tokenized {summary['documents']:,} documents from {summary['inputs']:,} files into "
        f"{summary['tokens']:,} tokens ({summary['dtype']}, vocab {summary['vocab_size']:,}) in "
        f"{summary['seconds']:.1f} s ({summary['tokens_per_s']:,.0f} tokens/s); wrote {splits}."
    )
    return 0
