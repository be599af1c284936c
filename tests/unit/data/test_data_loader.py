"""Per-rank batches, exact resume and held-out batches (optimus/data/loader.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optimus.data.dataset import TokenDataset, open_token_dataset
from optimus.data.errors import DataError
from optimus.data.loader import BatchLoader, heldout_batches, heldout_share
from optimus.data.mixture import Mixture

SEQ_LEN = 32


@pytest.fixture(scope="module")
def mixture(sotu_tokenized, wiki_tokenized) -> Mixture:
    sources = [open_token_dataset(sotu_tokenized), open_token_dataset(wiki_tokenized)]
    return Mixture(sources, [2.0, 1.0], SEQ_LEN, seed=7)


def _rows(micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in micro_batches]), torch.cat([y for _, y in micro_batches])


def test_micro_batches_have_shifted_labels(mixture):
    batch = BatchLoader(mixture, global_batch_size=8, micro_batch_size=2).next_batch()
    assert len(batch) == 4
    for inputs, labels in batch:
        assert inputs.shape == labels.shape == (2, SEQ_LEN) and inputs.dtype == labels.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
    inputs, labels = _rows(batch)
    assert torch.equal(inputs[3], torch.from_numpy(mixture.sample(3)[:-1]))


def test_ranks_concatenated_equal_the_single_process_batch(mixture):
    single = BatchLoader(mixture, global_batch_size=8, micro_batch_size=4)
    ranks = [BatchLoader(mixture, 8, micro_batch_size=2, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        expected = _rows(single.next_batch())
        combined = [_rows(rank.next_batch()) for rank in ranks]
        assert torch.equal(torch.cat([x for x, _ in combined]), expected[0])
        assert torch.equal(torch.cat([y for _, y in combined]), expected[1])


def test_resume_gives_the_same_batches_at_any_dp_size(mixture):
    uninterrupted = BatchLoader(mixture, 8, 4)
    reference = [_rows(uninterrupted.next_batch()) for _ in range(5)]
    first_run = BatchLoader(mixture, 8, 4)
    for _ in range(3):
        first_run.next_batch()
    state = first_run.state_dict()
    assert state == {"step": 3}
    resumed = BatchLoader(mixture, 8, 4)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_rows(resumed.next_batch()), reference[3]))
    # Resume the same state on 4 ranks: their slices still make up batches 3 and 4.
    ranks = [BatchLoader(mixture, 8, 1, dp_rank=r, dp_size=4) for r in range(4)]
    for rank in ranks:
        rank.load_state_dict({"step": torch.tensor(3)})
    for step in (3, 4):
        combined = [_rows(rank.next_batch()) for rank in ranks]
        assert torch.equal(torch.cat([x for x, _ in combined]), reference[step][0])


def test_batch_size_and_state_errors(mixture):
    with pytest.raises(DataError, match="not divisible by the 3 data-parallel ranks"):
        BatchLoader(mixture, 8, 1, dp_rank=0, dp_size=3)
    with pytest.raises(DataError, match="not divisible by micro batch size 3"):
        BatchLoader(mixture, 8, 3)
    with pytest.raises(DataError, match="rank 2 of 2 is invalid"):
        BatchLoader(mixture, 8, 1, dp_rank=2, dp_size=2)
    with pytest.raises(DataError, match="no valid step"):
        BatchLoader(mixture, 8, 1).load_state_dict({"steps": 3})


def test_a_negative_resume_step_is_refused(mixture):
    """A damaged checkpoint's step -1 would silently replay batch -1's samples: refuse it with the data error."""
    with pytest.raises(DataError, match="no valid step"):
        BatchLoader(mixture, 8, 1).load_state_dict({"step": -1})


def test_a_token_id_equal_to_the_vocab_size_is_refused(tmp_path, write_token_file):
    """Id vocab_size has no embedding row (ids run 0 .. vocab_size - 1): one DataError, not an IndexError mid-step."""
    source = TokenDataset(write_token_file(tmp_path / "train.bin", np.full(4 * (SEQ_LEN + 1), 9)))
    loader = BatchLoader(Mixture([source], [1.0], SEQ_LEN, seed=0), global_batch_size=2, micro_batch_size=1,
                         vocab_size=9)
    with pytest.raises(DataError, match="holds token id 9, outside model.vocab_size 9"):
        loader.next_batch()
    with pytest.raises(DataError, match="outside model.vocab_size 9"):
        heldout_batches([source], SEQ_LEN, batch_size=2, n_batches=1, vocab_size=9)
    assert len(BatchLoader(Mixture([source], [1.0], SEQ_LEN, seed=0), 2, 1, vocab_size=10).next_batch()) == 2


def _numbered_source(tmp_path, write_token_file, source: int, windows: int) -> TokenDataset:
    """A held-out file whose window i holds only the id 100 * source + i (so a row says where it came from)."""
    ids = np.repeat([100 * source + i for i in range(windows)], SEQ_LEN + 1)
    return TokenDataset(write_token_file(tmp_path / f"heldout-{source}.bin", ids))


def test_heldout_sources_of_unequal_length_are_used_in_full(tmp_path, write_token_file):
    """A short held-out source drops out of the round-robin; the longer ones' remaining windows are still evaluated."""
    sources = [_numbered_source(tmp_path, write_token_file, k, n) for k, n in enumerate((1, 3, 2))]
    inputs, _ = _rows(heldout_batches(sources, SEQ_LEN, batch_size=4, n_batches=3))
    assert inputs[:, 0].tolist() == [0, 100, 200, 101, 201, 102]


def test_heldout_shares_are_equal_when_the_windows_do_not_divide_by_the_ranks(tmp_path, write_token_file):
    """5 held-out windows over 2 ranks: both get 2 (one is left out), so a sharded model's forwards stay in step."""
    sources = [_numbered_source(tmp_path, write_token_file, k, n) for k, n in enumerate((2, 3))]
    shares = [heldout_share(sources, SEQ_LEN, 4, 2, micro_batch_size=1, dp_rank=r, dp_size=2) for r in range(2)]
    assert [len(share) for share in shares] == [2, 2]
    assert torch.cat([_rows(share)[0] for share in shares])[:, 0].tolist() == [0, 100, 1, 101]


def test_heldout_batches_are_fixed_and_round_robin(sotu_tokenized, wiki_tokenized):
    sources = [open_token_dataset(d, split="heldout") for d in (sotu_tokenized, wiki_tokenized)]
    batches = heldout_batches(sources, SEQ_LEN, batch_size=3, n_batches=2)
    assert len(batches) == 2 and all(x.shape == (3, SEQ_LEN) for x, _ in batches)
    inputs, labels = _rows(batches)
    expected_order = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    for row, (source, index) in enumerate(expected_order):
        window = torch.from_numpy(sources[source].instance(index, SEQ_LEN))
        assert torch.equal(inputs[row], window[:-1]) and torch.equal(labels[row], window[1:])
    again = heldout_batches(sources, SEQ_LEN, batch_size=3, n_batches=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    assert heldout_batches([], SEQ_LEN, 3, 2) == []  # nothing held out: the trainer skips evaluation
    with pytest.raises(DataError, match="must be positive"):
        heldout_batches(sources, SEQ_LEN, 0, 2)


def test_heldout_shares_split_one_fixed_set_over_the_ranks(sotu_tokenized, wiki_tokenized):
    sources = [open_token_dataset(d, split="heldout") for d in (sotu_tokenized, wiki_tokenized)]
    whole, _ = _rows(heldout_batches(sources, SEQ_LEN, batch_size=6, n_batches=2))
    one, _ = _rows(heldout_share(sources, SEQ_LEN, global_batch_size=6, n_batches=2, micro_batch_size=4))
    assert torch.equal(one, whole)  # one process: the whole set, in micro-batches
    shares = [heldout_share(sources, SEQ_LEN, 6, 2, micro_batch_size=2, dp_rank=r, dp_size=3) for r in range(3)]
    assert [len(share) for share in shares] == [2, 2, 2]  # the same number of forwards on every rank
    assert torch.equal(torch.cat([_rows(share)[0] for share in shares]), whole)
    assert heldout_share([], SEQ_LEN, 6, 2, 2, dp_rank=1, dp_size=2) == []


def test_training_data_without_a_micro_batch_gives_each_rank_its_share(small_token_dir):
    """A config with train.micro_batch_size unset (an imported run, evaluated without --data) still loads."""
    from optimus.config import build_config
    from optimus.data.build import build_training_data

    config = build_config({"model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_experts": 0, "ffn_hidden": 64},
                           "train": {"seq_len": 32, "global_batch_size": 8},
                           "data": {"sources": [{"path": str(small_token_dir)}]}})
    assert config.train.micro_batch_size is None
    loader = build_training_data(config, dp_rank=1, dp_size=2).loader
    assert loader.micro_batch_size == 4 and len(loader.next_batch()) == 1


def test_check_token_ids_refuses_a_negative_id_and_passes_an_empty_batch():
    from optimus.data.loader import check_token_ids

    with pytest.raises(DataError, match="^the batch holds token id -1, outside model.vocab_size 10: "):
        check_token_ids(np.array([[3, -1, 9]]), 10, "the batch")
    check_token_ids(np.empty((0, SEQ_LEN + 1), dtype=np.int64), 10, "the batch")


def test_a_bad_token_id_names_the_training_batch_counting_from_1(tmp_path, write_token_file):
    source = TokenDataset(write_token_file(tmp_path / "train.bin", np.full(4 * (SEQ_LEN + 1), 9)))
    loader = BatchLoader(Mixture([source], [1.0], SEQ_LEN, seed=0), 2, 1, vocab_size=9)
    loader.load_state_dict({"step": 4})
    with pytest.raises(DataError, match="^training batch 5 holds token id 9"):
        loader.next_batch()


@pytest.mark.parametrize("global_batch, micro_batch", [(8, 0), (8, -2), (0, 1)])
def test_batch_sizes_below_1_are_refused(mixture, global_batch, micro_batch):
    with pytest.raises(DataError, match="batch sizes must be positive"):
        BatchLoader(mixture, global_batch, micro_batch)


def test_a_numpy_integer_resume_step_is_accepted(mixture):
    loader = BatchLoader(mixture, 8, 4)
    loader.load_state_dict({"step": np.int64(3)})
    assert loader.step == 3 and type(loader.step) is int


@pytest.mark.parametrize("batch, count, micro", [(4, 0, 1), (0, 1, 1), (4, 1, 0)])
def test_heldout_batch_counts_and_sizes_below_1_are_refused(tmp_path, write_token_file, batch, count, micro):
    sources = [_numbered_source(tmp_path, write_token_file, 0, 4)]
    with pytest.raises(DataError, match="must be positive"):
        heldout_share(sources, SEQ_LEN, batch, count, micro_batch_size=micro)
    if micro:
        with pytest.raises(DataError, match="must be positive"):
            heldout_batches(sources, SEQ_LEN, batch_size=batch, n_batches=count)
