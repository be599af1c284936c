"""The Stateful pieces a checkpoint holds besides the model and optimizer (train/state.py): each comes back as it
was saved, through a real checkpoint (DCP and the safe reader)."""

from __future__ import annotations

import pytest
import torch

from optimus.checkpoint.manager import CheckpointManager
from optimus.train.state import RNGState


@pytest.fixture
def restore_global_generator():
    """The tests after this one in the same process draw from the generator as they found it."""
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


def test_the_global_generator_draws_after_a_resume_what_it_would_have_drawn(tmp_path, restore_global_generator):
    """Nothing in today's step draws from it (no dropout, router jitter or sampling in training; data order and
    initialization have their own seeded generators), so the exact-resume runs cannot see this: checked here."""
    torch.manual_seed(1234)
    torch.rand(5)  # a generator part-way through its stream, as training leaves it
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"rng": RNGState()}, {"contents": ["rng"]})
    expected = torch.rand(8)
    torch.manual_seed(99)  # a fresh process seeds again before it resumes
    manager.load(1, {"rng": RNGState()})
    assert torch.equal(torch.rand(8), expected)


def test_progress_comes_back_with_its_tokens_seen(tmp_path):
    from optimus.train.state import ProgressState

    progress = ProgressState()
    progress.step, progress.tokens_seen = 7, 3 * 2**40  # past 2^32: a long run's count
    manager = CheckpointManager(tmp_path)
    manager.save(7, {"progress": progress}, {"contents": ["progress"]})
    restored = ProgressState()
    manager.load(7, {"progress": restored})
    assert (restored.step, restored.tokens_seen) == (7, 3 * 2**40)
