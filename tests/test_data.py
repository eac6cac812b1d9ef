"""Tests for alignfl.core.data: the dataset registry, the loaders (alignfl.core.data.sources) and the tensor cache.

Everything runs offline: real loaders read tiny files written here in
torchvision's layouts. Partitioning is tests/test_partitioners.py's.
"""

from __future__ import annotations

import gzip
import pickle
import socket
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from alignfl.core import data
from alignfl.core.data import sources

pytestmark = pytest.mark.usefixtures("private_tensor_cache")

IDX_STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
needs_debian_fashion_mnist = pytest.mark.skipif(
    not all((sources.DEBIAN_FASHION_MNIST_DIR / f"{stem}.gz").is_file() for stem in IDX_STEMS),
    reason=f"Fashion-MNIST is not installed in {sources.DEBIAN_FASHION_MNIST_DIR} "
    "(apt-get install -y dataset-fashion-mnist)",
)


@pytest.fixture
def fresh_dataset_cache() -> Iterator[None]:
    """For tests that change where files are found: no cached dataset may answer for them."""
    data._load_cached.cache_clear()
    yield
    data._load_cached.cache_clear()


# --- writers for torchvision's on-disk formats ---------------------------------


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> None:
    """Write an unsigned-byte IDX file (the MNIST format)."""
    payload = b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload += np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


def write_mnist_raw(folder: Path, n_train: int, n_test: int, compress: bool = False) -> None:
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28))
        write_idx(folder / f"{split}-images-idx3-ubyte", images, compress)
        write_idx(folder / f"{split}-labels-idx1-ubyte", np.arange(n) % 10, compress)


def channel_coded_images(n: int) -> np.ndarray:
    """N x 3 x 32 x 32 images whose channel c is all 60 * (c + 1): shows layout mix-ups."""
    images = np.empty((n, 3, 32, 32), dtype=np.uint8)
    for channel in range(3):
        images[:, channel] = 60 * (channel + 1)
    return images


def write_pickle(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj))


def cifar_batch(n: int, label_key: str, label: int) -> dict[str, object]:
    """One pickled CIFAR batch: rows of 3,072 bytes, channel-major, as in the real files."""
    return {"data": channel_coded_images(n).reshape(n, -1), label_key: [label] * n}


def write_cifar10(root: Path, per_batch: int, n_test: int) -> None:
    folder = root / "cifar-10-batches-py"
    for i in range(1, 6):
        write_pickle(folder / f"data_batch_{i}", cifar_batch(per_batch, "labels", i))
    write_pickle(folder / "test_batch", cifar_batch(n_test, "labels", 0))
    write_pickle(folder / "batches.meta", {"label_names": [f"c{i}" for i in range(10)]})


def write_cifar100(root: Path, n_train: int, n_test: int) -> None:
    folder = root / "cifar-100-python"
    write_pickle(folder / "train", cifar_batch(n_train, "fine_labels", 99))
    write_pickle(folder / "test", cifar_batch(n_test, "fine_labels", 99))
    write_pickle(folder / "meta", {"fine_label_names": [f"c{i}" for i in range(100)]})


# Standard per-channel statistics, as published for each dataset.
CHANNEL_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}


def expected_channel_values(name: str) -> torch.Tensor:
    """What channel_coded_images become after the dataset's normalisation."""
    mean, std = CHANNEL_STATS[name]
    pixels = torch.tensor([60.0, 120.0, 180.0]) / 255
    return (pixels - torch.tensor(mean)) / torch.tensor(std)


@pytest.fixture
def skip_torchvision_md5(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchvision accepts CIFAR and SVHN files only if their MD5 matches the real
    release; tiny test files cannot, and the checksum is not what these tests are
    about, so the check is replaced by a plain existence test."""
    import torchvision.datasets.cifar as cifar
    import torchvision.datasets.svhn as svhn

    def exists(path: str, md5: str | None = None) -> bool:
        return Path(path).is_file()

    monkeypatch.setattr(cifar, "check_integrity", exists)
    monkeypatch.setattr(svhn, "check_integrity", exists)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every torchvision download fail the way it does offline."""
    import torchvision.datasets as tvd

    def refuse(self: object) -> None:
        raise RuntimeError("no network in tests")

    for cls in (tvd.MNIST, tvd.FashionMNIST, tvd.CIFAR10, tvd.CIFAR100, tvd.SVHN):
        monkeypatch.setattr(cls, "download", refuse)


# --- registry ------------------------------------------------------------------


def test_registry_lists_names() -> None:
    assert data.list_datasets() == [
        "cifar10",
        "cifar100",
        "digits",
        "fashion-mnist",
        "majority-tokens",
        "mnist",
        "svhn",
    ]
    assert data.DEFAULT_DATASET in data.list_datasets()


@pytest.mark.parametrize(
    "call",
    [
        lambda: data.load_dataset("imagenet"),
        lambda: data.dataset_info("imagenet"),
        lambda: data.check_dataset_available("imagenet", None),
    ],
)
def test_unknown_dataset_lists_allowed(call) -> None:
    with pytest.raises(ValueError, match="'imagenet'") as info:
        call()
    assert all(name in str(info.value) for name in data.list_datasets())


def test_dataset_info_is_static() -> None:
    assert data.dataset_info("fashion-mnist") == ((1, 28, 28), 10)
    assert data.dataset_info("digits") == ((1, 8, 8), 10)
    assert data.dataset_info("cifar100") == ((3, 32, 32), 100)
    assert data.dataset_info("svhn") == ((3, 32, 32), 10)


# --- loading -------------------------------------------------------------------


def test_digits_loads_normalised_and_cached() -> None:
    ds = data.load_dataset("digits")
    assert (len(ds.train_x), len(ds.test_x)) == (1437, 360)
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    assert abs(ds.train_x.mean().item()) < 0.05 and abs(ds.train_x.std().item() - 1) < 0.05
    assert set(ds.train_y.tolist()) == set(range(10)) == set(ds.test_y.tolist())
    assert data.load_dataset("digits") is ds


@needs_debian_fashion_mnist
def test_fashion_mnist_loads_from_debian_dir() -> None:
    ds = data.load_dataset("fashion-mnist")
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_x.dtype == torch.float32 and ds.test_y.dtype == torch.int64
    assert torch.bincount(ds.train_y).tolist() == [6000] * 10
    assert abs(ds.train_x.mean().item()) < 0.01 and abs(ds.train_x.std().item() - 1) < 0.01
    assert (ds.input_shape, ds.num_classes) == data.dataset_info("fashion-mnist")
    data.check_dataset_available("fashion-mnist", None)


@pytest.mark.parametrize("compress", [False, True])
def test_fashion_mnist_from_torchvision_root(tmp_path: Path, compress: bool) -> None:
    write_mnist_raw(tmp_path / "FashionMNIST" / "raw", n_train=30, n_test=10, compress=compress)
    data.check_dataset_available("fashion-mnist", str(tmp_path))
    ds = data.load_dataset("fashion-mnist", str(tmp_path))
    assert ds.train_x.shape == (30, 1, 28, 28) and ds.test_x.shape == (10, 1, 28, 28)
    assert ds.train_y.tolist() == [i % 10 for i in range(30)]


@needs_debian_fashion_mnist
def test_fashion_mnist_root_without_files_falls_back_to_debian(tmp_path: Path, no_network: None) -> None:
    data.check_dataset_available("fashion-mnist", str(tmp_path))
    assert len(data.load_dataset("fashion-mnist", str(tmp_path)).train_y) == 60000


def test_fashion_mnist_missing_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_dataset_cache: None, no_network: None
) -> None:
    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "not-installed")
    with pytest.raises(data.DatasetMissingError, match="apt-get install -y dataset-") as info:
        data.check_dataset_available("fashion-mnist", None)
    assert str(tmp_path / "not-installed") in str(info.value)
    root = tmp_path / "root"
    with pytest.raises(data.DatasetMissingError) as info:
        data.load_dataset("fashion-mnist", str(root))
    assert str(root / "FashionMNIST" / "raw") in str(info.value)


def test_mnist_from_torchvision_root(tmp_path: Path, no_network: None) -> None:
    write_mnist_raw(tmp_path / "MNIST" / "raw", n_train=20, n_test=10)
    data.check_dataset_available("mnist", str(tmp_path))
    ds = data.load_dataset("mnist", str(tmp_path))
    assert ds.train_x.shape == (20, 1, 28, 28) and ds.test_x.shape == (10, 1, 28, 28)
    assert ds.train_y.dtype == torch.int64 and ds.test_y.tolist() == list(range(10))
    raw = sources._read_idx(tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte")
    raw = torch.from_numpy(raw.copy())
    assert torch.allclose(ds.train_x[:, 0], (raw.float() / 255 - 0.1307) / 0.3081, atol=1e-5)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_from_torchvision_root(tmp_path: Path, name: str, skip_torchvision_md5: None, no_network: None) -> None:
    if name == "cifar10":
        write_cifar10(tmp_path, per_batch=4, n_test=3)
        n_train, label = 20, 1
    else:
        write_cifar100(tmp_path, n_train=6, n_test=3)
        n_train, label = 6, 99
    data.check_dataset_available(name, str(tmp_path))
    ds = data.load_dataset(name, str(tmp_path))
    assert ds.train_x.shape == (n_train, 3, 32, 32) and ds.test_x.shape == (3, 3, 32, 32)
    assert ds.num_classes == data.dataset_info(name)[1]
    assert ds.train_y[0].item() == label
    per_channel = ds.train_x.mean(dim=(0, 2, 3))
    assert torch.allclose(per_channel, expected_channel_values(name), atol=1e-4)


def test_svhn_from_torchvision_root(tmp_path: Path, skip_torchvision_md5: None, no_network: None) -> None:
    from scipy.io import savemat

    for name, n in (("train", 5), ("test", 2)):
        images = channel_coded_images(n).transpose(2, 3, 1, 0)  # SVHN's .mat holds H x W x C x N
        labels = np.full((n, 1), 10, dtype=np.uint8)
        savemat(tmp_path / f"{name}_32x32.mat", {"X": images, "y": labels})
    ds = data.load_dataset("svhn", str(tmp_path))
    assert ds.train_x.shape == (5, 3, 32, 32) and ds.test_x.shape == (2, 3, 32, 32)
    assert ds.train_y.tolist() == [0] * 5  # SVHN's label 10 is the digit 0
    per_channel = ds.train_x.mean(dim=(0, 2, 3))
    assert torch.allclose(per_channel, expected_channel_values("svhn"), atol=1e-4)


def test_missing_mnist_root_names_the_path(tmp_path: Path, no_network: None) -> None:
    root = tmp_path / "nowhere"
    with pytest.raises(data.DatasetMissingError) as info:
        data.check_dataset_available("mnist", str(root))
    message = str(info.value)
    assert str(root / "MNIST" / "raw" / "train-images-idx3-ubyte") in message
    assert "no network in tests" in message
    with pytest.raises(data.DatasetMissingError, match=str(root)):
        data.load_dataset("mnist", str(root))
    assert isinstance(info.value, FileNotFoundError)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No name resolves, as on a machine without a network: torchvision's real download code runs and fails
    (after making its folders, unlike with ``no_network``)."""

    def fail(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "offline (test)")

    monkeypatch.setattr(socket, "getaddrinfo", fail)


@pytest.mark.parametrize("name", ["mnist", "cifar10", "svhn"])
def test_a_failed_download_to_the_default_root_leaves_no_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None, name: str
) -> None:
    home = tmp_path / "home"
    monkeypatch.setattr(sources, "DEFAULT_DATA_ROOT", str(home / ".cache" / "alignfl" / "data"))
    with pytest.raises(
        data.DatasetMissingError, match="(?s)Downloading them failed \\(offline\\?\\).*offline \\(test\\)"
    ):
        data.check_dataset_available(name, None)
    assert not home.exists()


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "cifar10", "svhn"])
def test_a_failed_download_to_an_empty_data_root_leaves_it_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None, fresh_dataset_cache: None, name: str
) -> None:
    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "not-installed")
    root = tmp_path / "root"
    root.mkdir()
    (root / "kept.txt").write_text("the user's")
    with pytest.raises(data.DatasetMissingError, match=str(root)):
        data.check_dataset_available(name, str(root))
    assert [path.name for path in root.iterdir()] == ["kept.txt"]


def test_corrupt_cifar_is_reported_missing(tmp_path: Path, no_network: None) -> None:
    write_cifar10(tmp_path, per_batch=2, n_test=2)  # MD5s cannot match torchvision's
    with pytest.raises(data.DatasetMissingError, match="cifar-10-batches-py"):
        data.load_dataset("cifar10", str(tmp_path))


def test_check_available_is_cheap_when_files_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_mnist_raw(tmp_path / "MNIST" / "raw", n_train=2, n_test=2)

    def fail(*args: object) -> None:
        raise AssertionError("check_dataset_available loaded data although the files exist")

    monkeypatch.setattr(data, "load_dataset", fail)
    data.check_dataset_available("mnist", str(tmp_path))
    data.check_dataset_available("digits", None)


def test_a_loaded_dataset_is_read_back_from_the_tensor_cache_until_its_sources_change(
    private_tensor_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process (here: the in-process cache cleared) reads the tensors instead of loading again; a new
    fingerprint (another scikit-learn) or an unreadable file loads from the source."""
    first = data.load_dataset("digits")
    (stored,) = private_tensor_cache.glob("digits-*.pt")
    entry = data.DATASETS.get("digits")
    data._load_cached.cache_clear()
    monkeypatch.setitem(data.DATASETS._entries, "digits", replace(entry, load=lambda root: pytest.fail("loaded again")))
    again = data.load_dataset("digits")
    assert all(
        torch.equal(getattr(again, key), getattr(first, key)) for key in ("train_x", "train_y", "test_x", "test_y")
    )
    assert (again.name, again.num_classes) == ("digits", 10)

    loads = []
    monkeypatch.setitem(
        data.DATASETS._entries,
        "digits",
        replace(entry, load=lambda root: loads.append(root) or first, fingerprint=lambda root: "scikit-learn 99"),
    )
    data._load_cached.cache_clear()
    data.load_dataset("digits")
    assert loads == [None] and len(list(private_tensor_cache.glob("digits-*.pt"))) == 2
    stored.write_bytes(b"not a tensor file")
    monkeypatch.setitem(data.DATASETS._entries, "digits", replace(entry, load=lambda root: loads.append(root) or first))
    data._load_cached.cache_clear()
    assert torch.equal(data.load_dataset("digits").train_x, first.train_x)
    assert loads == [None, None] and not list(private_tensor_cache.glob("*.tmp"))
