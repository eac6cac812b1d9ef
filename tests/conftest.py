"""Shared test set-up."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

LONGEST_FIRST = (
    "test_presets.py",
    "test_deploy_loopback.py",
    "test_ray_cluster.py",
    "test_sweep_runs.py",
    "test_end_to_end.py",
    "test_plugins.py",
    "test_vectorised.py",
    "test_deploy_tls.py",
    "test_launch.py",
    "test_tracking.py",
    "test_batched_ray_cluster.py",
    "test_batched_engine.py",
    "test_wheel.py",
)
"""Test files that take longest (tens of seconds to minutes: deployments, Ray, launcher runs, preset jobs, the
algorithm-model pairs), longest first (seconds in the suite of a fresh clone on this 2-core machine, under its own
load: 179, 163, 90, 84, 78, 73, 54, 47, 43, 32, 29, 28, 25). ``scripts/test.sh`` runs the files on two workers, a
file at a time to a worker (``--dist loadfile``) in the order collected (``--no-loadscope-reorder``): the long ones
start first and the many short files fill in at the end, so no worker is left alone with a long file."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in :data:`LONGEST_FIRST`'s order, then the other files with ``slow`` tests (most first), then the
    rest; each file's tests keep their order."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.path.name] = slow.get(item.path.name, 0) + (item.get_closest_marker("slow") is not None)

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(name)
        return (1, -slow[name]) if slow[name] else (2, 0)

    items.sort(key=rank)  # stable: collection order within a rank and within a file


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """One intra-op thread: on a shared 2-core machine, two threads run ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_seam_warnings():
    """Each test sees the seam's once-per-process warnings afresh (alignfl/fl_app/patches/seam.py)."""
    from alignfl.fl_app.patches import seam

    seam.warn_once.cache_clear()


@pytest.fixture(autouse=True)
def _private_client_state(monkeypatch, tmp_path_factory):
    """In-process nodes keep their client-state snapshots in a folder of the test's own, never in ~/.cache."""
    root = tmp_path_factory.mktemp("client-state")
    monkeypatch.setattr("alignfl.fl_app.node_state.default_state_root", lambda: root)


@pytest.fixture
def private_tensor_cache(tmp_path, monkeypatch):
    """An empty tensor cache of the test's own, and datasets loaded afresh in the test (no test writes to the
    home folder)."""
    from alignfl.core import data

    folder = tmp_path / "tensors"
    monkeypatch.setattr(data, "TENSOR_CACHE_DIR", str(folder))
    data._load_cached.cache_clear()
    yield folder
    data._load_cached.cache_clear()  # later tests must not get this test's memory-mapped files


@pytest.fixture
def private_partition_cache(tmp_path, monkeypatch):
    """An empty disk cache of partitions of the test's own: partitioning really runs, and no test writes to the
    home folder."""
    from alignfl.core.partitioning import partitions

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


@pytest.fixture
def fresh_temp(monkeypatch) -> Iterator[Path]:
    """An empty system temporary folder of the test's own (``tempfile``'s in this process, ``$TMPDIR`` for the
    processes it starts), short enough a path for Ray's sockets: what a command leaves in it is there to see."""
    folder = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
