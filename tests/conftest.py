"""Suite-wide settings: quiet, deterministic, and marker handling for GPU tests."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# the CPU speed probe's cache (optimus.train.hardware): the repository's own, never the user's home
os.environ["XDG_CACHE_HOME"] = str(Path(__file__).resolve().parents[1] / ".cache")

# Under pytest-xdist (`make test` runs two workers): each worker gets its own torchrun / TCPStore port, so two
# launches at once do not both bind the default 29500, and one thread per worker, so the two workers do not
# oversubscribe the cores (the gloo ranks the tests fork use one thread each already).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw"):
    _port = str(29600 + 50 * int(_WORKER[2:]))
    os.environ["MASTER_PORT"] = os.environ["PET_MASTER_PORT"] = _port  # PET_*: torchrun's --master-port default
    os.environ["OMP_NUM_THREADS"] = "1"  # read when torch is imported (the test modules, after this file)


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
