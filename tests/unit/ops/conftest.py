"""Op tests use tiny tensors: one intra-op thread avoids OpenMP spin-waits on a shared machine."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
