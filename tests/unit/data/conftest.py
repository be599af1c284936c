"""Shared fixtures for the data pipeline tests: small real text, the real OLMoE tokenizer."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from optimus.data.sources import _sotu_files, iter_packaged_documents, load_tokenizer
from optimus.data.tokenize import tokenize_documents, tokenize_files


@pytest.fixture(scope="session")
def olmoe_tokenizer():
    """The real OLMoE tokenizer, loaded once."""
    return load_tokenizer("olmoe")


@pytest.fixture(scope="session")
def small_speeches() -> list[Path]:
    """The four shortest State of the Union speeches (a few thousand tokens in all), in name order."""
    return sorted(sorted(_sotu_files(), key=lambda p: (p.stat().st_size, p.name))[:4])


@pytest.fixture(scope="session")
def sotu_tokenized(tmp_path_factory, small_speeches) -> Path:
    """Directory with train/heldout token files of the small speeches (1 of 4 held out)."""
    output = tmp_path_factory.mktemp("sotu")
    tokenize_files([str(p) for p in small_speeches], "olmoe", output, heldout_fraction=0.25, workers=1, progress=False)
    return output


@pytest.fixture(scope="session")
def wiki_tokenized(tmp_path_factory) -> Path:
    """Directory with train/heldout token files of the first 30 Wikipedia summaries."""
    output = tmp_path_factory.mktemp("wiki")
    documents = islice(iter_packaged_documents("wiki-offline"), 30)
    tokenize_documents(documents, "olmoe", output, heldout_fraction=0.1, workers=1, progress=False)
    return output


@pytest.fixture
def write_token_file():
    """Write a token array + sidecar in the on-disk format; returns the .bin path.

    Synthetic ids let mixture and loader tests read back which source and instance a sample is.
    """

    def write(path: Path, tokens, dtype: str = "uint16") -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        array = np.asarray(tokens, dtype=dtype)
        array.tofile(path)
        sidecar = {"dtype": dtype, "tokens": len(array), "documents": 1, "tokenizer_sha256": "test", "eos_id": 0}
        path.with_suffix(".json").write_text(json.dumps(sidecar))
        return path

    return write
