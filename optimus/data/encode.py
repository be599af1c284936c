"""Parallel, order-preserving tokenization of a stream of documents.

Documents are grouped into batches of about a megabyte of text; batches go to a fork-based
multiprocessing Pool (or are encoded in-process for one worker) and come back in input order, so
the token stream is identical whatever the number of workers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from optimus.data.sources import load_tokenizer, resolve_tokenizer_path


def encode_documents(tokenizer, documents: list[str], eos_id: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `documents`, each followed by EOS, concatenated; plus each one's length.

    No special tokens are added (no BOS): like OLMo, documents are separated by EOS only.
    """
    encoded = [tokenizer.encode(text, add_special_tokens=False).ids for text in documents]
    lengths = np.array([len(ids) + 1 if ids else 0 for ids in encoded], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    position = 0
    for ids in encoded:
        if ids:  # a document with no tokens gets no EOS either: it does not exist
            tokens[position : position + len(ids)] = ids
            tokens[position + len(ids)] = eos_id
            position += len(ids) + 1
    return tokens, lengths


# Pool workers load the tokenizer once in their initializer and keep it here. This lives only in
# the worker processes (multiprocessing's API leaves no other place for per-worker state).
_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    from tokenizers import Tokenizer

    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_file(tokenizer_path)


def _encode_in_worker(documents: list[str], eos_id: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    return encode_documents(_worker_tokenizer, documents, eos_id, dtype)


def batched_documents(documents: Iterable[str], batch_chars: int) -> Iterator[list[str]]:
    """Group documents into lists of about `batch_chars` characters (empty documents dropped)."""
    batch, chars = [], 0
    for text in documents:
        if not text:
            continue
        batch.append(text)
        chars += len(text)
        if chars >= batch_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


@contextlib.contextmanager
def worker_pool(tokenizer_spec: str, workers: int):
    """A fork-based Pool whose workers each hold the tokenizer, or None for in-process work."""
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield None
        return
    # fork: workers start in milliseconds. Each re-loads the tokenizer from its file rather than
    # sharing the parent's, since the Rust object is not fork-aware.
    context = multiprocessing.get_context("fork")
    initargs = (str(resolve_tokenizer_path(tokenizer_spec)),)
    with context.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        yield pool


def encoded_batches(
    batches: Iterable[list[str]], pool, workers: int, tokenizer_spec: str, eos_id: int, dtype: np.dtype
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (tokens, lengths) per batch, in input order whatever the number of workers."""
    if pool is None:
        tokenizer = load_tokenizer(tokenizer_spec)
        for documents in batches:
            yield encode_documents(tokenizer, documents, eos_id, dtype.str)
        return
    # A bounded queue of pending tasks, consumed in submission order: output is ordered and memory
    # stays flat (Pool.imap would read the whole input ahead of slow workers).
    pending: deque = deque()
    for documents in batches:
        pending.append(pool.apply_async(_encode_in_worker, (documents, eos_id, dtype.str)))
        if len(pending) >= 2 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
