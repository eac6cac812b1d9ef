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
def _fresh_seam_warnings():
    """Each test sees the seam's once-per-process warnings afresh (fl_app/patches/seam.py)."""
    from fl_app.patches import seam

    seam.warn_once.cache_clear()


@pytest.fixture(autouse=True)
def _private_client_state(monkeypatch, tmp_path_factory):
    """In-process nodes keep their client-state snapshots in a folder of the test's own, never in ~/.cache."""
    root = tmp_path_factory.mktemp("client-state")
    monkeypatch.setattr("fl_app.node_state.default_state_root", lambda: root)


@pytest.fixture
def private_tensor_cache(tmp_path, monkeypatch):
    """An empty tensor cache of the test's own, and datasets loaded afresh in the test (no test writes to the
    home folder)."""
    from core import data

    folder = tmp_path / "tensors"
    monkeypatch.setattr(data, "TENSOR_CACHE_DIR", str(folder))
    data._load_cached.cache_clear()
    yield folder
    data._load_cached.cache_clear()  # later tests must not get this test's memory-mapped files


@pytest.fixture
def private_partition_cache(tmp_path, monkeypatch):
    """An empty disk cache of partitions of the test's own: partitioning really runs, and no test writes to the
    home folder."""
    from core.partitioning import partitions

    folder = tmp_path / "partitions"
    monkeypatch.setattr(partitions, "PARTITION_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def exposed_key_repo(tmp_path):
    """A git work tree holding a private key its ignore rules do not cover (``keys/auth``), and one they do
    (``certs/ca.key``): a checkout after ``make_certs.sh`` into a folder of its own."""
    import subprocess

    repo = tmp_path / "checkout"
    (repo / "keys").mkdir(parents=True)
    (repo / "certs").mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("certs/\n")
    key = "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----\n"
    (repo / "keys" / "auth").write_text(key)
    (repo / "certs" / "ca.key").write_text(key.replace("OPENSSH ", ""))
    return repo
