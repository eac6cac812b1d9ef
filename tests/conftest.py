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


@pytest.fixture(autouse=True)
def _private_client_state(monkeypatch, tmp_path_factory):
    """In-process nodes keep their client-state snapshots in a folder of the test's own, never in ~/.cache."""
    root = tmp_path_factory.mktemp("client-state")
    monkeypatch.setattr("fl_app.node_state.default_state_root", lambda: root)
