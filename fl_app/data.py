"""Datasets and federated partitions, loaded once per process.

A dataset is read from local files, normalised with its standard per-channel
mean/std and held as tensors in a per-process cache, so that a simulation
process serving many clients reads and converts it once. A partition is a pure
function of (dataset, data root, partitioner, its parameters, number of
partitions, seed); all partitions of a split are computed together, by
flwr-datasets' partitioners, and cached.

Where the files come from:

* ``fashion-mnist`` (the default): Debian's ``dataset-fashion-mnist`` package
  (``/usr/share/datasets/fashion-mnist``), or a torchvision root given as
  ``data_root`` (``<root>/FashionMNIST/raw/*-ubyte[.gz]``), which is preferred
  when it has the files; with a root and a network, torchvision downloads them.
* ``digits``: scikit-learn's bundled 8x8 digits; always offline.
* ``mnist``, ``cifar10``, ``cifar100``, ``svhn``: torchvision's dataset classes
  over ``data_root`` (``~/.cache/alignfl/data`` when unset), downloading only
  when the files are absent.

Heavy libraries (torchvision, scikit-learn, flwr-datasets with pyarrow) are
imported inside the functions that need them, so that a process which only
loads Fashion-MNIST does not pay seconds of import time for them.
"""

from __future__ import annotations

import functools
import gzip
import math
import numbers
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner

DEFAULT_DATASET = "fashion-mnist"
DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
# Root for the torchvision datasets when no data-root is given; expanded per call.
DEFAULT_DATA_ROOT = "~/.cache/alignfl/data"
# Dirichlet: every client gets at least one sample, and otherwise the skew that
# alpha asks for (no self-balancing, see _build_dirichlet).
DIRICHLET_MIN_PARTITION_SIZE = 1
# Pathological: client i always holds class i % num_classes (so every class is
# used once there are at least as many clients as classes); the others are drawn
# at random from the seeded generator, as in Li et al. (2021), NIID-Bench.
PATHOLOGICAL_CLASS_ASSIGNMENT = "first-deterministic"

_IDX_STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class DatasetMissingError(FileNotFoundError):
    """A dataset's files are absent and cannot be fetched.

    The message names the files looked for, where, and how to get them.
    """


@dataclass(frozen=True, eq=False)
class ImageDataset:
    """A labelled image dataset as normalised tensors.

    The tensors are shared through the per-process cache: never modify them in place.
    """

    name: str
    train_x: torch.Tensor  # float32, N x C x H x W, normalised
    train_y: torch.Tensor  # int64
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Shape of one image, C x H x W."""
        channels, height, width = self.train_x.shape[1:]
        return channels, height, width


Loader = Callable[[Path | None], ImageDataset]
MissingFiles = Callable[[Path | None], list[Path]]
Split = tuple[np.ndarray, np.ndarray]  # N x C x H x W uint8 images, labels


@dataclass(frozen=True)
class _DatasetEntry:
    load: Loader
    input_shape: tuple[int, int, int]
    num_classes: int
    missing_files: MissingFiles


_DATASETS: dict[str, _DatasetEntry] = {}


def _nothing_missing(data_root: Path | None) -> list[Path]:
    """For datasets that ship with an installed package."""
    return []


def register_dataset(
    name: str,
    *,
    input_shape: tuple[int, int, int],
    num_classes: int,
    missing_files: MissingFiles = _nothing_missing,
) -> Callable[[Loader], Loader]:
    """Register a loader ``(data_root) -> ImageDataset`` under ``name``.

    ``input_shape`` and ``num_classes`` are declared here so that configs can be
    validated and models built without reading any data; ``missing_files``
    lists the required files that are absent, for a cheap check before training.
    """

    def decorator(loader: Loader) -> Loader:
        if name in _DATASETS:
            raise ValueError(f"dataset {name!r} is already registered")
        _DATASETS[name] = _DatasetEntry(loader, input_shape, num_classes, missing_files)
        return loader

    return decorator


def list_datasets() -> list[str]:
    """Names accepted by ``load_dataset``."""
    return sorted(_DATASETS)


def _dataset_entry(name: str) -> _DatasetEntry:
    if name not in _DATASETS:
        raise ValueError(f"dataset: unknown value {name!r}; allowed: {', '.join(list_datasets())}")
    return _DATASETS[name]


def _resolve_root(data_root: str | Path | None) -> Path | None:
    """An absolute root, or None when unset (None or empty string)."""
    return Path(data_root).expanduser().resolve() if data_root else None


def dataset_info(name: str) -> tuple[tuple[int, int, int], int]:
    """``(input_shape, num_classes)`` of a registered dataset, without loading it."""
    entry = _dataset_entry(name)
    return entry.input_shape, entry.num_classes


def load_dataset(name: str, data_root: str | None = None) -> ImageDataset:
    """Load a dataset once per process (cached on its name and resolved root)."""
    _dataset_entry(name)
    return _load_cached(name, _resolve_root(data_root))


@functools.lru_cache(maxsize=4)
def _load_cached(name: str, root: Path | None) -> ImageDataset:
    entry = _DATASETS[name]
    dataset = entry.load(root)
    if (dataset.input_shape, dataset.num_classes) != (entry.input_shape, entry.num_classes):
        raise ValueError(
            f"dataset {name!r} loaded as {dataset.input_shape} with {dataset.num_classes} classes, "
            f"but is registered as {entry.input_shape} with {entry.num_classes}"
        )
    return dataset


def check_dataset_available(name: str, data_root: str | None) -> None:
    """Raise DatasetMissingError before any training if a dataset cannot be had.

    When the files are present this costs a few stat calls. When some are
    absent, the one thing that can still succeed is a download, so the dataset
    is loaded (downloading where the loader can, or raising); it stays cached.
    """
    if _dataset_entry(name).missing_files(_resolve_root(data_root)):
        load_dataset(name, data_root)


def _missing(name: str, looked_for: Sequence[Path | str], how: str) -> DatasetMissingError:
    paths = "\n  ".join(str(path) for path in looked_for)
    return DatasetMissingError(f"dataset {name!r} not found; looked for:\n  {paths}\n{how}")


def _to_image_dataset(
    name: str,
    train: Split,
    test: Split,
    *,
    num_classes: int,
    mean: Sequence[float],
    std: Sequence[float],
    max_value: float = 255.0,
) -> ImageDataset:
    """Scale N x C x H x W pixels to [0, 1], then standardise per channel."""
    mean_c = np.asarray(mean, dtype=np.float32).reshape(-1, 1, 1)
    std_c = np.asarray(std, dtype=np.float32).reshape(-1, 1, 1)

    def images(x: np.ndarray) -> torch.Tensor:
        out = x.astype(np.float32)  # a fresh, writable copy: normalised in place
        out /= max_value
        out -= mean_c
        out /= std_c
        return torch.from_numpy(out)

    def labels(y: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(y, dtype=np.int64))

    return ImageDataset(
        name=name,
        train_x=images(train[0]),
        train_y=labels(train[1]),
        test_x=images(test[0]),
        test_y=labels(test[1]),
        num_classes=num_classes,
    )


# --- IDX files (MNIST family), read without torchvision ---------------------


def _read_idx(path: Path) -> np.ndarray:
    """Parse an unsigned-byte IDX file, gzip'd when its name ends in .gz."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        data = handle.read()
    if len(data) < 4 or data[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _idx_file(folder: Path, stem: str) -> Path | None:
    """The file for ``stem`` in ``folder``, uncompressed or gzip'd."""
    return next((path for path in (folder / stem, folder / f"{stem}.gz") if path.is_file()), None)


def _read_idx_splits(folder: Path) -> tuple[Split, Split]:
    """(train, test) splits from a folder of MNIST-style IDX files."""
    train_x, train_y, test_x, test_y = (_read_idx(_idx_file(folder, stem)) for stem in _IDX_STEMS)
    return (train_x[:, None], train_y), (test_x[:, None], test_y)


def _fashion_mnist_folders(data_root: Path | None) -> list[Path]:
    """Where Fashion-MNIST is looked for, preferred first."""
    root_folder = [data_root / "FashionMNIST" / "raw"] if data_root is not None else []
    return [*root_folder, DEBIAN_FASHION_MNIST_DIR]


def _fashion_mnist_folder(data_root: Path | None) -> Path | None:
    return next(
        (
            folder
            for folder in _fashion_mnist_folders(data_root)
            if all(_idx_file(folder, stem) for stem in _IDX_STEMS)
        ),
        None,
    )


def _fashion_mnist_missing(data_root: Path | None) -> list[Path]:
    if _fashion_mnist_folder(data_root) is not None:
        return []
    return [
        folder / f"{stem}[.gz]"
        for folder in _fashion_mnist_folders(data_root)
        for stem in _IDX_STEMS
    ]


_FASHION_MNIST_HOW = (
    "Install Debian's package as root "
    "(`apt-get update && apt-get install -y dataset-fashion-mnist`), "
    "or set data-root to a torchvision root holding FashionMNIST/raw/*-ubyte[.gz] "
    "(with network access the files are downloaded there)."
)


@register_dataset(
    "fashion-mnist", input_shape=(1, 28, 28), num_classes=10, missing_files=_fashion_mnist_missing
)
def _load_fashion_mnist(data_root: Path | None) -> ImageDataset:
    folder = _fashion_mnist_folder(data_root)
    if folder is None and data_root is not None:
        fashion_mnist = _torchvision_class("FashionMNIST")
        _open_torchvision(
            "fashion-mnist",
            lambda download: fashion_mnist(str(data_root), train=True, download=download),
            _fashion_mnist_missing(data_root),
            _FASHION_MNIST_HOW,
        )
        folder = _fashion_mnist_folder(data_root)
    if folder is None:
        raise _missing("fashion-mnist", _fashion_mnist_missing(data_root), _FASHION_MNIST_HOW)
    train, test = _read_idx_splits(folder)
    return _to_image_dataset(
        "fashion-mnist", train, test, num_classes=10, mean=(0.2860,), std=(0.3530,)
    )


@register_dataset("digits", input_shape=(1, 8, 8), num_classes=10)
def _load_digits(data_root: Path | None) -> ImageDataset:
    """scikit-learn's 1,797 8x8 digits (values 0-16), stratified 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    train_x, test_x, train_y, test_y = train_test_split(
        digits.images[:, None], digits.target, test_size=0.2, stratify=digits.target, random_state=0
    )
    # Mean and std of the whole set scaled to [0, 1].
    return _to_image_dataset(
        "digits",
        (train_x, train_y),
        (test_x, test_y),
        num_classes=10,
        mean=(0.3053,),
        std=(0.3760,),
        max_value=16.0,
    )


# --- torchvision datasets ----------------------------------------------------


def _torchvision_root(data_root: Path | None) -> Path:
    return data_root if data_root is not None else Path(DEFAULT_DATA_ROOT).expanduser()


def _files_under_root(relative: Sequence[str]) -> MissingFiles:
    """A ``missing_files`` for datasets kept under a torchvision root."""

    def missing(data_root: Path | None) -> list[Path]:
        root = _torchvision_root(data_root)
        return [root / path for path in relative if not (root / path).is_file()]

    return missing


def _open_torchvision(
    name: str, make: Callable[[bool], Any], looked_for: Sequence[Path | str], how: str
) -> Any:
    """``make(download)`` from local files, downloading only when they are absent.

    torchvision raises RuntimeError for absent or corrupt files; a failed
    download raises RuntimeError (MNIST's mirrors) or OSError (URLError).
    """
    try:
        return make(False)
    except RuntimeError:
        pass
    try:
        return make(True)
    except (OSError, RuntimeError) as err:
        raise _missing(name, looked_for, f"Downloading them failed ({err}).\n{how}") from err


def _torchvision_class(class_name: str) -> Any:
    """A torchvision dataset class, imported on first use (the import takes seconds)."""
    import torchvision.datasets

    return getattr(torchvision.datasets, class_name)


def _register_torchvision(
    name: str,
    class_name: str,
    *,
    files: Sequence[str],
    split_kwargs: Callable[[bool], dict[str, Any]],
    arrays: Callable[[Any], Split],
    input_shape: tuple[int, int, int],
    num_classes: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> None:
    """Register a dataset read by ``torchvision.datasets.<class_name>`` from a data root.

    ``files`` are the paths under the root that torchvision needs,
    ``split_kwargs(train)`` selects a split, and ``arrays`` turns an opened
    split into N x C x H x W uint8 images and labels.
    """

    def load(data_root: Path | None) -> ImageDataset:
        root = _torchvision_root(data_root)
        how = (
            f"Put the files under {root} in torchvision's layout (e.g. copied from a machine "
            f"with network access), or set data-root to a root that has them. "
            f"Without data-root the root is {DEFAULT_DATA_ROOT}."
        )

        def open_split(train: bool) -> Split:
            def make(download: bool) -> Any:
                cls = _torchvision_class(class_name)
                return cls(str(root), download=download, **split_kwargs(train))

            return arrays(_open_torchvision(name, make, [root / path for path in files], how))

        return _to_image_dataset(
            name, open_split(True), open_split(False), num_classes=num_classes, mean=mean, std=std
        )

    register_dataset(
        name,
        input_shape=input_shape,
        num_classes=num_classes,
        missing_files=_files_under_root(files),
    )(load)


def _train_flag(train: bool) -> dict[str, Any]:
    return {"train": train}


def _mnist_arrays(split: Any) -> Split:
    """torchvision keeps MNIST as an N x H x W uint8 tensor."""
    return split.data.numpy()[:, None], split.targets.numpy()


def _cifar_arrays(split: Any) -> Split:
    """torchvision keeps CIFAR as N x H x W x C uint8."""
    return split.data.transpose(0, 3, 1, 2), np.asarray(split.targets)


def _svhn_arrays(split: Any) -> Split:
    """Already N x C x H x W; torchvision maps SVHN's label 10 to the digit 0."""
    return split.data, split.labels


_register_torchvision(
    "mnist",
    "MNIST",
    files=[f"MNIST/raw/{stem}" for stem in _IDX_STEMS],
    split_kwargs=_train_flag,
    arrays=_mnist_arrays,
    input_shape=(1, 28, 28),
    num_classes=10,
    mean=(0.1307,),
    std=(0.3081,),
)
_register_torchvision(
    "cifar10",
    "CIFAR10",
    files=[
        f"cifar-10-batches-py/{file}"
        for file in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
    ],
    split_kwargs=_train_flag,
    arrays=_cifar_arrays,
    input_shape=(3, 32, 32),
    num_classes=10,
    mean=(0.4914, 0.4822, 0.4465),
    std=(0.2470, 0.2435, 0.2616),
)
_register_torchvision(
    "cifar100",
    "CIFAR100",
    files=[f"cifar-100-python/{file}" for file in ("train", "test", "meta")],
    split_kwargs=_train_flag,
    arrays=_cifar_arrays,
    input_shape=(3, 32, 32),
    num_classes=100,
    mean=(0.5071, 0.4865, 0.4409),
    std=(0.2673, 0.2564, 0.2762),
)
_register_torchvision(
    "svhn",  # the train and test splits; not 'extra'
    "SVHN",
    files=["train_32x32.mat", "test_32x32.mat"],
    split_kwargs=lambda train: {"split": "train" if train else "test"},
    arrays=_svhn_arrays,
    input_shape=(3, 32, 32),
    num_classes=10,
    mean=(0.4377, 0.4438, 0.4728),
    std=(0.1980, 0.2010, 0.1970),
)


# --- partitioning --------------------------------------------------------------


@dataclass(frozen=True)
class _PartitionSettings:
    """Validated partitioning parameters; field names are the run-config keys in snake case."""

    num_partitions: int
    seed: int
    dirichlet_alpha: float
    classes_per_client: int
    shards_per_client: int


_PartitionerBuilder = Callable[[_PartitionSettings], "Partitioner"]


@dataclass(frozen=True)
class _PartitionerEntry:
    build: _PartitionerBuilder
    keys: tuple[str, ...]  # run-config keys it reads, named when it fails


_PARTITIONERS: dict[str, _PartitionerEntry] = {}


def _partitioner(
    name: str, keys: tuple[str, ...] = ()
) -> Callable[[_PartitionerBuilder], _PartitionerBuilder]:
    """Register a builder of an flwr-datasets partitioner under ``name``."""

    def decorator(build: _PartitionerBuilder) -> _PartitionerBuilder:
        _PARTITIONERS[name] = _PartitionerEntry(build, ("num-partitions", *keys))
        return build

    return decorator


@_partitioner("iid")
def _build_iid(settings: _PartitionSettings) -> Partitioner:
    """Contiguous equal blocks; random because the rows are shuffled by the seed first."""
    from flwr_datasets.partitioner import IidPartitioner

    return IidPartitioner(num_partitions=settings.num_partitions)


@_partitioner("dirichlet", keys=("dirichlet-alpha",))
def _build_dirichlet(settings: _PartitionSettings) -> Partitioner:
    """Per-class Dirichlet(alpha) shares (Hsu et al. 2019).

    flwr's default min_partition_size=10 re-draws up to 10 times and then fails;
    at alpha=0.1 with 100 clients on Fashion-MNIST most draws have a client
    below 10, so we only insist on non-empty clients. Where even that is out of
    reach (100 clients on the 1,437 digits at alpha=0.1) the partitioner gives
    up after 10 draws and partition_dataset raises a ValueError naming the keys;
    it never hangs. Self-balancing is off: it stops filling clients above the
    mean size, which skews late classes away from what alpha asks for.
    """
    from flwr_datasets.partitioner import DirichletPartitioner

    return DirichletPartitioner(
        num_partitions=settings.num_partitions,
        partition_by="label",
        alpha=settings.dirichlet_alpha,
        min_partition_size=DIRICHLET_MIN_PARTITION_SIZE,
        self_balancing=False,
        seed=settings.seed,
    )


@_partitioner("pathological", keys=("classes-per-client",))
def _build_pathological(settings: _PartitionSettings) -> Partitioner:
    """Each client holds exactly classes-per-client classes, split evenly among their holders."""
    from flwr_datasets.partitioner import PathologicalPartitioner

    return PathologicalPartitioner(
        num_partitions=settings.num_partitions,
        partition_by="label",
        num_classes_per_partition=settings.classes_per_client,
        class_assignment_mode=PATHOLOGICAL_CLASS_ASSIGNMENT,
        seed=settings.seed,
    )


@_partitioner("shard", keys=("shards-per-client",))
def _build_shard(settings: _PartitionSettings) -> Partitioner:
    """McMahan et al. (2017): sort by label, cut equal shards, deal some to each client.

    Shards have floor(N / (clients * shards)) samples, so up to
    clients * shards - 1 samples are left out.
    """
    from flwr_datasets.partitioner import ShardPartitioner

    return ShardPartitioner(
        num_partitions=settings.num_partitions,
        partition_by="label",
        num_shards_per_partition=settings.shards_per_client,
        seed=settings.seed,
    )


def list_partitioners() -> list[str]:
    """Names accepted by ``partition_dataset``."""
    return sorted(_PARTITIONERS)


def _require_int(key: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high], or a ValueError naming the key."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if low <= int(value) and (high is None or int(value) <= high):
            return int(value)
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    raise ValueError(f"{key} must be {allowed}, got {value!r}")


def partition_dataset(
    dataset: str,
    data_root: str | None,
    partitioner: str,
    num_partitions: int,
    seed: int,
    dirichlet_alpha: float = 0.5,
    classes_per_client: int = 2,
    shards_per_client: int = 2,
) -> tuple[np.ndarray, ...]:
    """Read-only index arrays into the train split, one per partition.

    A pure function of its arguments, cached per process: all partitions are
    computed in one go, so any number of clients costs one partitioning.
    """
    _, num_classes = dataset_info(dataset)
    if partitioner not in _PARTITIONERS:
        allowed = ", ".join(list_partitioners())
        raise ValueError(f"partitioner: unknown value {partitioner!r}; allowed: {allowed}")
    if not (
        isinstance(dirichlet_alpha, numbers.Real)
        and math.isfinite(dirichlet_alpha)
        and dirichlet_alpha > 0
    ):
        raise ValueError(f"dirichlet-alpha must be a finite number > 0, got {dirichlet_alpha!r}")
    settings = _PartitionSettings(
        num_partitions=_require_int("num-partitions", num_partitions, 1),
        seed=_require_int("seed", seed, 0),
        dirichlet_alpha=float(dirichlet_alpha),
        classes_per_client=_require_int(
            "classes-per-client", classes_per_client, 1, num_classes
        ),
        shards_per_client=_require_int("shards-per-client", shards_per_client, 1),
    )
    return _compute_partitions(dataset, _resolve_root(data_root), partitioner, settings)


@functools.lru_cache(maxsize=8)
def _compute_partitions(
    dataset: str, root: Path | None, partitioner: str, settings: _PartitionSettings
) -> tuple[np.ndarray, ...]:
    from datasets import Dataset

    labels = _load_cached(dataset, root).train_y.numpy()
    # Shuffle rows by the seed: IidPartitioner cuts contiguous blocks, and the
    # label partitioners take each class's samples in row order.
    order = np.random.default_rng(settings.seed).permutation(len(labels))
    entry = _PARTITIONERS[partitioner]
    split = entry.build(settings)
    split.dataset = Dataset.from_dict({"label": labels[order], "index": order})
    try:
        parts = tuple(
            np.asarray(split.load_partition(pid)["index"][:], dtype=np.int64)
            for pid in range(settings.num_partitions)
        )
    except ValueError as err:  # an infeasible combination, found by the partitioner
        given = ", ".join(
            f"{key}={getattr(settings, key.replace('-', '_'))}" for key in entry.keys
        )
        raise ValueError(
            f"partitioner {partitioner!r} cannot split {dataset}'s {len(labels)} training samples "
            f"with {given} (seed={settings.seed}); change these settings. "
            f"flwr-datasets said: {err}"
        ) from err
    for part in parts:
        part.flags.writeable = False  # shared through the cache
    return parts


def client_split(
    indices: np.ndarray, test_fraction: float, seed: int, partition_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle one partition and split it into (train, local test).

    The generator is seeded by (seed, partition_id), so each client gets its own
    split, the same in every round and process. The test part has
    round(n * test_fraction) samples, but at least one sample stays for training.
    """
    if not isinstance(test_fraction, numbers.Real) or not 0 <= test_fraction < 1:
        raise ValueError(f"test-fraction must be a number in [0, 1), got {test_fraction!r}")
    rng = np.random.default_rng(
        [_require_int("seed", seed, 0), _require_int("partition-id", partition_id, 0)]
    )
    shuffled = rng.permutation(np.asarray(indices))
    num_test = min(round(len(shuffled) * test_fraction), max(len(shuffled) - 1, 0))
    return shuffled[num_test:], shuffled[:num_test]
