"""OLMo/Dolma token files (optimus/data/npy.py) and mixture recipes (optimus/data/recipe.py)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from optimus.data.config import DataConfig, DataSource
from optimus.data.dataset import open_token_dataset
from optimus.data.errors import DataError
from optimus.data.loader import BatchLoader
from optimus.data.mixture import Mixture
from optimus.data.npy import TokenFiles, dtype_for_vocab
from optimus.data.recipe import recipe_sources
from optimus.data.sources import iter_packaged_documents

SEQ_LEN = 32
VOCAB, EOS = 50280, 50279
RECIPE = Path(__file__).resolve().parents[3] / "configs" / "data" / "olmoe-mix-0924.yaml"


def write_olmo_files(sotu_tokenized: Path, out: Path, dtype: str, parts: int = 3) -> np.ndarray:
    """Our tokenized speeches cut into `parts` headerless files of `dtype`, as AI2 ships them; returns all ids."""
    ids = np.fromfile(sotu_tokenized / "train.bin", dtype=np.uint16)
    out.mkdir(parents=True, exist_ok=True)
    for k, chunk in enumerate(np.array_split(ids, parts)):
        chunk.astype(dtype).tofile(out / f"part-{k}-00000.npy")
    return ids


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_headerless_files_give_per_file_windows_of_the_ids(sotu_tokenized, tmp_path, dtype):
    ids = write_olmo_files(sotu_tokenized, tmp_path, dtype)
    files = TokenFiles(str(tmp_path / "*.npy"), VOCAB, EOS, dtype=dtype)
    chunks = np.array_split(ids, 3)
    assert files.num_tokens == len(ids) and len(files.files) == 3
    assert files.num_instances(SEQ_LEN) == sum(len(c) // (SEQ_LEN + 1) for c in chunks)
    # the first window of the second file starts that file's ids: windows never span two files (as in OLMo)
    first_of_second = len(chunks[0]) // (SEQ_LEN + 1)
    assert np.array_equal(files.instance(first_of_second, SEQ_LEN), chunks[1][: SEQ_LEN + 1].astype(np.int64))
    assert np.array_equal(files.instance(1, SEQ_LEN), chunks[0][SEQ_LEN + 1 : 2 * SEQ_LEN + 2].astype(np.int64))
    assert len(files.document_ends()) == int((ids == EOS).sum()) > 0
    assert pickle.loads(pickle.dumps(files)).num_tokens == files.num_tokens


def test_dtype_follows_the_vocabulary_and_real_npy_headers_are_read(sotu_tokenized, tmp_path):
    assert dtype_for_vocab(50280) == np.uint16 and dtype_for_vocab(100278) == np.uint32
    ids = np.fromfile(sotu_tokenized / "train.bin", dtype=np.uint16)
    np.save(tmp_path / "real.npy", ids.astype(np.uint32))  # with a header: the header's dtype wins
    files = TokenFiles(str(tmp_path / "real.npy"), VOCAB, EOS)
    assert files.num_tokens == len(ids)
    assert np.array_equal(files.instance(0, SEQ_LEN), ids[: SEQ_LEN + 1].astype(np.int64))
    np.save(tmp_path / "big-endian.npy", ids.astype(">u2"))
    big = TokenFiles(str(tmp_path / "big-endian.npy"), VOCAB, EOS)
    assert np.array_equal(big.instance(2, SEQ_LEN), files.instance(2, SEQ_LEN))


def test_bad_files_are_one_clear_error(sotu_tokenized, tmp_path):
    with pytest.raises(DataError, match="no files match"):
        TokenFiles(str(tmp_path / "nothing" / "*.npy"), VOCAB, EOS)
    ids = write_olmo_files(sotu_tokenized, tmp_path / "u32", "uint32")
    with pytest.raises(DataError, match="looks like uint32"):
        TokenFiles(str(tmp_path / "u32" / "*.npy"), VOCAB, EOS)  # dtype inferred (uint16) but files are uint32
    (tmp_path / "u16").mkdir()
    ids[:1000].tofile(tmp_path / "u16" / "part-0.npy")  # uint16 ids read as uint32 pair up into huge ids
    with pytest.raises(DataError, match="beyond the vocabulary of 50280"):
        TokenFiles(str(tmp_path / "u16" / "*.npy"), VOCAB, EOS, dtype="uint32")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "part-0.npy").write_bytes(ids[:100].astype(np.uint32).tobytes()[:-1])
    with pytest.raises(DataError, match="not a whole number of uint32 tokens"):
        TokenFiles(str(odd / "*.npy"), VOCAB, EOS, dtype="uint32")


def test_an_id_equal_to_the_vocab_size_is_refused(tmp_path):
    """Ids run 0 .. vocab_size - 1: a file holding id vocab_size was made for another vocabulary and is refused."""
    ids = np.arange(1, 1001, dtype=np.uint16)
    ids[500] = VOCAB
    ids.tofile(tmp_path / "part-0.npy")
    with pytest.raises(DataError, match=f"holds token id {VOCAB}, beyond the vocabulary of {VOCAB}"):
        TokenFiles(str(tmp_path / "*.npy"), VOCAB, EOS, dtype="uint16")
    ids[500] = VOCAB - 1
    ids.tofile(tmp_path / "part-0.npy")
    assert TokenFiles(str(tmp_path / "*.npy"), VOCAB, EOS, dtype="uint16").num_tokens == 1000


def test_out_of_vocabulary_ids_only_at_the_end_of_a_file_are_caught(tmp_path):
    """The id check samples a file's start, middle and end: a foreign tail (e.g. a file appended to) is refused."""
    ids = (np.arange(20_000) % 1000 + 1).astype(np.uint16)  # far longer than the start and middle samples cover
    ids[-3:] = VOCAB + 5
    ids.tofile(tmp_path / "part-0.npy")
    with pytest.raises(DataError, match=f"holds token id {VOCAB + 5}, beyond the vocabulary"):
        TokenFiles(str(tmp_path / "*.npy"), VOCAB, EOS, dtype="uint16")


def test_an_explicit_uint16_dtype_overrides_the_looks_like_uint32_guess(tmp_path):
    """Every second id zero suggests uint32 files read as uint16, but a dtype the user set is trusted, not refused."""
    ids = np.zeros(2000, dtype=np.uint16)
    ids[::2] = np.arange(1000) % 500 + 1
    ids.tofile(tmp_path / "part-0.npy")
    with pytest.raises(DataError, match="looks like uint32"):
        TokenFiles(str(tmp_path / "*.npy"), VOCAB, EOS)  # dtype inferred from the vocabulary: refused
    files = TokenFiles(str(tmp_path / "*.npy"), VOCAB, EOS, dtype="uint16")
    assert files.num_tokens == 2000 and files.dtype == np.uint16


def test_mixing_with_a_packaged_style_source_keeps_exact_resume(sotu_tokenized, wiki_tokenized, tmp_path):
    write_olmo_files(sotu_tokenized, tmp_path, "uint32")
    sources = [TokenFiles(str(tmp_path / "*.npy"), VOCAB, EOS, dtype="uint32"), open_token_dataset(wiki_tokenized)]
    mixture = Mixture(sources, [3.0, 1.0], SEQ_LEN, seed=3)
    assert {mixture.source_of(i) for i in range(64)} == {0, 1}
    loader = BatchLoader(mixture, global_batch_size=4, micro_batch_size=2)
    loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(3)]
    resumed = BatchLoader(Mixture(sources, [3.0, 1.0], SEQ_LEN, seed=3), global_batch_size=4, micro_batch_size=2)
    resumed.load_state_dict(state)
    for want, got in zip(expected, (resumed.next_batch() for _ in range(3))):
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(want, got))


def test_config_takes_exactly_one_location():
    assert DataSource(glob="/d/*.npy", dtype="uint32", eos_id=EOS).glob == "/d/*.npy"
    with pytest.raises(ValueError, match="exactly one"):
        DataSource(glob="/d/*.npy", path="/d")
    with pytest.raises(ValueError, match="both set, and a recipe replaces the sources: delete the data.sources list"):
        DataConfig(recipe=str(RECIPE), sources=[{"name": "sotu"}])


def _make_mix(root: Path, leave_out: str | None = None) -> None:
    recipe = yaml.safe_load(RECIPE.read_text())
    for name, entry in recipe["sources"].items():
        if name != leave_out:
            folder = root / Path(entry["path"]).parent
            folder.mkdir(parents=True)
            np.full(100, 7, dtype=np.uint16).tofile(folder / "part-0.npy")


def test_recipe_weights_are_the_published_token_counts(tmp_path):
    _make_mix(tmp_path)
    sources = recipe_sources(DataConfig(recipe=str(RECIPE), root=str(tmp_path), weights={"wikipedia": 3.0e9}))
    weights = {Path(s.glob).parent.name: s.weight for s in sources}
    assert weights == {"dclm": 3.86e12, "starcoder": 101e9, "pes2o": 57e9, "arxiv": 21e9, "open-web-math": 13e9,
                       "algebraic-stack": 13e9, "wikipedia": 3.0e9}
    moved = tmp_path / "elsewhere" / "*.npy"
    moved.parent.mkdir()
    np.full(100, 7, dtype=np.uint16).tofile(moved.parent / "a.npy")
    sources = recipe_sources(DataConfig(recipe=str(RECIPE), root=str(tmp_path), paths={"arxiv": str(moved)},
                                        weights={"wikipedia": 0, "dclm": 1.0}))
    assert len(sources) == 6 and sources[0].weight == 1.0 and sources[3].glob == str(moved)
    with pytest.raises(DataError, match="source arxiv: no files at"):
        recipe_sources(DataConfig(recipe=str(RECIPE), root=str(tmp_path), paths={"arxiv": str(tmp_path / "x/*.npy")},
                                  weights={"wikipedia": 1.0}))


def test_recipe_mistakes_name_the_source(tmp_path):
    _make_mix(tmp_path, leave_out="pes2o")
    with pytest.raises(DataError, match="source wikipedia .* has no token count: set data.weights.wikipedia"):
        recipe_sources(DataConfig(recipe=str(RECIPE), root=str(tmp_path), weights={"pes2o": 0}))
    with pytest.raises(DataError, match=f"source pes2o: no files at {tmp_path}/pes2o/"):
        recipe_sources(DataConfig(recipe=str(RECIPE), root=str(tmp_path), weights={"wikipedia": 1.0}))
    with pytest.raises(DataError, match="set data.root"):
        recipe_sources(DataConfig(recipe=str(RECIPE), weights={"wikipedia": 1.0}))
    with pytest.raises(DataError, match="not in recipe"):
        recipe_sources(DataConfig(recipe=str(RECIPE), root=str(tmp_path), weights={"c4": 1.0}))
    with pytest.raises(DataError, match="not found"):
        recipe_sources(DataConfig(recipe=str(tmp_path / "none.yaml")))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"sources: \xff\n")
    with pytest.raises(DataError, match=r"is not UTF-8 text \(byte 9\)"):
        recipe_sources(DataConfig(recipe=str(binary)))


def test_a_negative_recipe_weight_is_refused_naming_it(tmp_path):
    """A negative data.weights entry is a typo, not a way to leave a source out: one error naming the weight."""
    _make_mix(tmp_path)
    with pytest.raises(DataError, match="data.weights.arxiv is -1.0: use a non-negative weight"):
        recipe_sources(DataConfig(recipe=str(RECIPE), root=str(tmp_path), weights={"wikipedia": 1.0, "arxiv": -1.0}))


def test_training_data_mixes_npy_files_with_a_packaged_corpus(sotu_tokenized, tmp_path, monkeypatch):
    from itertools import islice

    from optimus.config import build_config
    from optimus.data import tokenize as tokenize_module
    from optimus.data.build import build_training_data

    six_docs = lambda name: islice(iter_packaged_documents(name), 6)  # noqa: E731 - keeps the test fast
    monkeypatch.setattr(tokenize_module, "iter_packaged_documents", six_docs)
    write_olmo_files(sotu_tokenized, tmp_path / "npy", "uint32")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"dtype": "uint32", "sources": {"speeches": {"tokens": 3e9, "path": "npy/*.npy"}}}))
    train = {"seq_len": SEQ_LEN, "global_batch_size": 4, "micro_batch_size": 2}
    model = {"d_model": 32, "n_layers": 1, "n_heads": 2, "vocab_size": 50304}
    for data in ({"sources": [{"glob": str(tmp_path / "npy" / "*.npy"), "dtype": "uint32", "weight": 3.0},
                              {"name": "sotu", "weight": 1.0}]},
                 {"recipe": str(recipe), "root": str(tmp_path)}):
        config = build_config({"model": model, "train": train, "data": {**data, "cache_dir": str(tmp_path / "cache")}})
        built = build_training_data(config)
        datasets = built.loader.mixture.datasets
        assert isinstance(datasets[0], TokenFiles) and datasets[0].dtype == np.uint32 and datasets[0].eos_id == EOS
        assert len(built.heldout) == (1 if "sources" in data else 0)  # only the packaged corpus has a held-out split
        inputs, labels = built.loader.next_batch()[0]
        assert inputs.shape == (2, SEQ_LEN) and int(inputs.max()) < VOCAB


def test_ids_below_65536_are_stored_in_16_bits_and_larger_vocabularies_in_32():
    """OLMo's rule at its edge: a vocabulary of 65,536 ids (0..65535) still fits uint16, one more does not; the
    tokenizer's writer and the .npy reader agree on it."""
    from optimus.data.npy import dtype_for_vocab
    from optimus.data.tokenize import token_dtype

    for choose in (dtype_for_vocab, token_dtype):
        assert [choose(v) for v in (50_304, 65_536, 65_537, 200_000)] == [np.uint16, np.uint16, np.uint32, np.uint32]


def test_a_real_npy_of_signed_ids_is_refused(tmp_path):
    np.save(tmp_path / "signed.npy", np.arange(100, dtype=np.int32))
    with pytest.raises(DataError, match="holds a int32 array of shape \\(100,\\): token files must be flat unsigned"):
        TokenFiles(str(tmp_path / "signed.npy"), VOCAB, EOS)


def test_a_short_file_with_zeros_at_odd_positions_is_not_taken_for_uint32(tmp_path):
    np.array([5, 0, 7, 0, 9, 0], dtype=np.uint16).tofile(tmp_path / "short.npy")
    assert TokenFiles(str(tmp_path / "short.npy"), VOCAB, EOS).num_tokens == 6


def test_windows_and_document_ends_are_counted_across_the_files(tmp_path):
    np.array([1, 2, EOS, 3, 4], dtype=np.uint16).tofile(tmp_path / "a.npy")  # 2 windows of 2 tokens
    np.array([EOS, 5, 6, EOS], dtype=np.uint16).tofile(tmp_path / "b.npy")  # 2 more
    files = TokenFiles(str(tmp_path / "*.npy"), VOCAB, EOS)
    assert files.document_ends().tolist() == [2, 5, 8]
    assert files.num_instances(1) == 4 and files.instance(3, 1).tolist() == [6, EOS]
    with pytest.raises(IndexError, match="instance 4 out of range"):
        files.instance(4, 1)
    with pytest.raises(DataError, match="seq_len is 0: use a positive sequence length"):
        files.num_instances(0)


def test_a_file_whose_name_looks_like_a_glob_is_read_as_named(tmp_path):
    path = tmp_path / "tokens[0].npy"
    np.arange(1, 9, dtype=np.uint16).tofile(path)
    assert TokenFiles(str(path), VOCAB, EOS).files == [path]


def _recipe(folder: Path, sources) -> Path:
    path = folder / "mix.yaml"
    recipe = {"name": "mix", "dtype": "uint16", "eos_id": 0, "sources": sources}
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.mark.parametrize("sources, problem", [
    ({}, "has no 'sources' mapping"),
    ({"web": {"tokens": 5}}, "source 'web' needs a 'path'"),
    ({"web": {"tokens": "lots", "path": "web/*.npy"}}, "source 'web' has tokens 'lots': write a number like"),
])
def test_recipe_file_mistakes_are_one_line(tmp_path, sources, problem):
    from optimus.data.recipe import load_recipe

    with pytest.raises(DataError, match=problem):
        load_recipe(str(_recipe(tmp_path, sources)))


def test_a_recipe_is_found_relative_to_the_working_folder_and_its_sources_keep_their_own_dtype(tmp_path,
                                                                                                 monkeypatch):
    from optimus.data.recipe import load_recipe

    for name in ("web", "code"):
        (tmp_path / name).mkdir()
        np.full(100, 7, dtype=np.uint16).tofile(tmp_path / name / "a.npy")
    _recipe(tmp_path, {"web": {"tokens": "3.86e12", "path": "web/*.npy"},
                       "code": {"tokens": 1e9, "path": "code/*.npy", "dtype": "uint32", "eos_id": 5}})
    monkeypatch.chdir(tmp_path)
    assert load_recipe("mix.yaml")["sources"]["web"]["tokens"] == 3.86e12
    sources = recipe_sources(DataConfig(recipe="mix.yaml", root=str(tmp_path)))
    assert [(s.weight, s.dtype, s.eos_id) for s in sources] == [(3.86e12, "uint16", 0), (1e9, "uint32", 5)]
    with pytest.raises(DataError, match="every source of recipe mix.yaml has weight 0"):
        recipe_sources(DataConfig(recipe="mix.yaml", root=str(tmp_path), weights={"web": 0, "code": 0}))
