"""The parity harness itself: fixed real-token batches, rank slices that add up, a strict comparison."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.parity import (
    RunRecord,
    assert_parity,
    global_batches,
    rank_micro_batches,
    tiny_config,
)


def test_global_batches_are_fixed_real_tokens():
    config = tiny_config()
    first, again = global_batches(config, 2), global_batches(config, 3)
    inputs, labels = first[0]
    assert inputs.shape == labels.shape == (8, 32)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are the inputs shifted by one
    assert torch.equal(first[1][0], again[1][0])  # a step's batch does not depend on the run length
    assert 0 < int(inputs.max()) < config.model.vocab_size and len(inputs.unique()) > 50
    # folded into the small vocabulary, the ids still reach every tp shard of the LM head
    assert int(inputs.min()) < config.model.vocab_size // 4 and int(inputs.max()) >= 3 * config.model.vocab_size // 4


def test_the_full_vocabulary_keeps_the_tokenizers_ids():
    config = tiny_config(model=dict(vocab_size=50304))
    inputs, _ = global_batches(config, 1)[0]
    assert int(inputs.max()) >= 1000  # not folded: the OLMoE ids as they are


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_rank_slices_are_the_global_batch_in_the_same_micro_batches(dp_size):
    batch = global_batches(tiny_config(), 1)[0]
    whole = rank_micro_batches(batch, micro_batch_size=2)
    parts = [mb for rank in range(dp_size) for mb in rank_micro_batches(batch, 2, rank, dp_size)]
    assert len(parts) == len(whole) == 4
    for (got_in, got_lab), (want_in, want_lab) in zip(parts, whole):
        assert torch.equal(got_in, want_in) and torch.equal(got_lab, want_lab)


def test_assert_parity_names_the_step_and_the_parameter():
    reference = RunRecord(losses=[10.0, 9.0], grads={"w": torch.ones(3)})
    assert_parity(reference, RunRecord(losses=[10.00001, 9.0005], grads={"w": torch.ones(3) + 1e-6}))
    with pytest.raises(AssertionError, match="step 2"):
        assert_parity(reference, RunRecord(losses=[10.0, 9.01], grads={"w": torch.ones(3)}))
    with pytest.raises(AssertionError, match="w: gradient differs"):
        assert_parity(reference, RunRecord(losses=[10.0, 9.0], grads={"w": torch.ones(3) * 1.01}))
    with pytest.raises(AssertionError, match="no gradient gathered"):
        assert_parity(reference, RunRecord(losses=[10.0, 9.0], grads={}))
