"""Suite-wide settings: quiet, deterministic, and marker handling for GPU tests."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# the CPU speed probe's cache (optimus.train.hardware): the repository's own, never the user's home
os.environ["XDG_CACHE_HOME"] = str(Path(__file__).resolve().parents[1] / ".cache")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def small_token_dir(tmp_path_factory):
    """Three State of the Union speeches tokenized with the OLMoE tokenizer, once per test session."""
    from tests.helpers.runs import tokenize_small_corpus

    return tokenize_small_corpus(tmp_path_factory.mktemp("small-tokens"))
