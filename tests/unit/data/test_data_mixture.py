"""Deterministic weighted mixtures (optimus/data/mixture.py)."""

from __future__ import annotations

import numpy as np
import pytest

from optimus.data.dataset import TokenDataset, open_token_dataset
from optimus.data.errors import DataError
from optimus.data.mixture import Mixture, apportion_slots

SEQ_LEN = 7  # windows of 8 tokens


@pytest.fixture
def labelled_sources(tmp_path, write_token_file):
    """Three sources whose token ids say which source and instance a window is: source k's
    instance i holds ids 1000*k + 8*i ... 1000*k + 8*i + 7."""
    sizes = [40, 25, 10]  # instances per source
    return [
        TokenDataset(write_token_file(tmp_path / f"s{k}.bin", 1000 * k + np.arange(8 * n)))
        for k, n in enumerate(sizes)
    ]


def _identity(window: np.ndarray) -> tuple[int, int]:
    """(source, instance) of a window from `labelled_sources`."""
    return int(window[0] // 1000), int(window[0] % 1000 // 8)


def test_same_seed_same_samples_other_seed_other_order(labelled_sources):
    first = Mixture(labelled_sources, [1, 1, 1], SEQ_LEN, seed=3)
    again = Mixture(labelled_sources, [1, 1, 1], SEQ_LEN, seed=3)
    other = Mixture(labelled_sources, [1, 1, 1], SEQ_LEN, seed=4)
    same = [np.array_equal(first.sample(i), again.sample(i)) for i in range(300)]
    differs = [np.array_equal(first.sample(i), other.sample(i)) for i in range(300)]
    assert all(same) and not all(differs)


def test_sample_is_a_pure_function_of_the_index(labelled_sources):
    sequential = Mixture(labelled_sources, [3, 2, 1], SEQ_LEN, seed=0, block_size=64)
    expected = {i: sequential.sample(i) for i in range(600)}
    shuffled = Mixture(labelled_sources, [3, 2, 1], SEQ_LEN, seed=0, block_size=64)
    # Jumping around (across blocks and epochs, so the caches evict) must not change anything.
    for i in np.random.default_rng(0).permutation(600):
        np.testing.assert_array_equal(shuffled.sample(int(i)), expected[int(i)])
    windows = [expected[i] for i in range(600)]
    assert all(np.array_equal(w, np.arange(w[0], w[0] + 8)) for w in windows)  # real, aligned windows


def test_sources_follow_the_weights(labelled_sources):
    mixture = Mixture(labelled_sources, [0.5, 0.3, 0.2], SEQ_LEN, seed=1, block_size=100)
    counts = np.bincount([mixture.source_of(i) for i in range(1000)], minlength=3)
    assert counts.tolist() == [500, 300, 200]  # exact over whole blocks
    partial = np.bincount([mixture.source_of(i) for i in range(1030)], minlength=3) - counts
    assert partial.sum() == 30 and all(partial <= [50, 30, 20])
    assert mixture.epochs_seen(1030) == pytest.approx([c / n for c, n in zip(counts + partial, [40, 25, 10])])


def test_each_block_interleaves_the_sources_in_its_own_order(labelled_sources):
    """Not one order repeated every block_size samples (a periodic pattern a model can learn), nor the sources in
    runs: each block is its own shuffle of its slots."""
    mixture = Mixture(labelled_sources, [0.5, 0.3, 0.2], SEQ_LEN, seed=1, block_size=30)
    blocks = [tuple(mixture.source_of(i) for i in range(30 * b, 30 * (b + 1))) for b in range(6)]
    assert len(set(blocks)) == 6
    assert all(block != tuple(sorted(block)) for block in blocks)


def test_every_instance_once_per_epoch_in_a_new_order(labelled_sources):
    mixture = Mixture(labelled_sources, [1, 1, 1], SEQ_LEN, seed=2, block_size=30)
    per_source: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for i in range(600):
        source, instance = _identity(mixture.sample(i))
        per_source[source].append(instance)
    for source, n in zip(per_source, [40, 25, 10]):
        seen = per_source[source]
        epochs = [seen[e * n : (e + 1) * n] for e in range(len(seen) // n)]
        assert len(epochs) >= 4
        assert all(sorted(epoch) == list(range(n)) for epoch in epochs)
        assert epochs[0] != epochs[1] and epochs[0] != list(range(n))


def test_real_text_mixture(sotu_tokenized, wiki_tokenized):
    sources = [open_token_dataset(sotu_tokenized), open_token_dataset(wiki_tokenized)]
    mixture = Mixture(sources, [1.0, 1.0], seq_len=128, seed=0)
    samples = [mixture.sample(i) for i in range(64)]
    assert all(s.shape == (129,) and s.dtype == np.int64 and s.max() < 50280 for s in samples)
    assert sorted({mixture.source_of(i) for i in range(64)}) == [0, 1]


def test_apportion_slots():
    assert apportion_slots([1, 1, 0.5], 4096) == [1639, 1638, 819]
    assert apportion_slots([1, 1e-6], 10) == [9, 1]  # a tiny weight still gets a slot
    assert apportion_slots([1, 0], 5) == [5, 0]


def test_invalid_mixtures_raise(labelled_sources, tmp_path, write_token_file):
    with pytest.raises(DataError, match="3 data sources but 2 weights"):
        Mixture(labelled_sources, [1, 1], SEQ_LEN, seed=0)
    with pytest.raises(DataError, match="weights .* are invalid"):
        Mixture(labelled_sources, [1, -1, 1], SEQ_LEN, seed=0)
    with pytest.raises(DataError, match="at least one source"):
        Mixture([], [], SEQ_LEN, seed=0)
    with pytest.raises(DataError, match="fewer than seq_len"):
        Mixture(labelled_sources, [1, 1, 1], seq_len=100, seed=0)
    foreign = TokenDataset(write_token_file(tmp_path / "foreign.bin", np.arange(80)))
    foreign.meta["tokenizer_sha256"] = "another tokenizer"
    with pytest.raises(DataError, match="different tokenizers"):
        Mixture([labelled_sources[0], foreign], [1, 1], SEQ_LEN, seed=0)


def test_apportion_slots_takes_excess_back_only_from_sources_above_one_slot():
    assert apportion_slots([1000, 1, 1], 3) == [1, 1, 1]


def test_the_lru_cache_keeps_the_most_recently_used_items_up_to_its_capacity():
    from optimus.data.mixture import _LRUCache

    cache, computed = _LRUCache(capacity=2), []

    def get(key):
        return cache.get(key, lambda: computed.append(key) or np.array(key))

    for key in ("a", "b", "a", "c", "a", "b"):
        get(key)
    assert computed == ["a", "b", "c", "b"]  # "a" used again stays; "b" then least recent goes when "c" comes


def test_mixture_boundaries(labelled_sources):
    mixture = Mixture(labelled_sources, [1, 1, 1], SEQ_LEN, seed=0, block_size=3)  # one slot per source
    assert sorted(mixture.source_of(i) for i in range(3)) == [0, 1, 2]
    with pytest.raises(DataError, match="block_size 2 is smaller than the 3 sources"):
        Mixture(labelled_sources, [1, 1, 1], SEQ_LEN, seed=0, block_size=2)
    with pytest.raises(DataError, match="seed is -1: use a non-negative integer"):
        Mixture(labelled_sources, [1, 1, 1], SEQ_LEN, seed=-1)
    with pytest.raises(DataError, match="weights .* are invalid: use non-negative numbers, not all zero"):
        Mixture(labelled_sources, [0, 0, 0.0], SEQ_LEN, seed=0)
    with pytest.raises(IndexError, match="sample index -1 is negative"):
        mixture.sample(-1)


def test_a_source_of_more_windows_than_int16_holds_is_permuted_whole(tmp_path, write_token_file):
    source = TokenDataset(write_token_file(tmp_path / "big.bin", np.zeros(2 * 40_000)))
    mixture = Mixture([source], [1.0], seq_len=1, seed=0)
    order = mixture._instance_permutation(0, 0)
    assert np.array_equal(np.sort(order), np.arange(40_000))
    assert mixture.locate(4096 * 9)[2] == int(order[4096 * 9])
