"""Shared test set-up."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """One intra-op thread: on a shared 2-core machine, two threads run ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
