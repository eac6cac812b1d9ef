"""The data sets: their registry, each loaded once per process and kept in a tensor cache.

A dataset is read from local files, normalised with its standard per-channel
mean/std and held as tensors in a per-process cache, so that a simulation
process serving many clients reads and converts it once; a machine-wide tensor
cache spares other processes the parsing. How a data set is split over clients
is :mod:`alignfl.core.partitioning`'s job.

This package's modules declare the data sets (:mod:`alignfl.core.data.sources`: where
each one's files come from and how they are read; :mod:`alignfl.core.data.tokens`
generates the synthetic token task) or change a client's share of them
(:mod:`alignfl.core.data.label_noise`); importing the package imports every one of them,
and each registers its data sets in :data:`DATASETS`, so a module dropped here
adds data sets with no other line to edit.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from alignfl.plugins.registry import Registry, import_modules

DEFAULT_DATASET = "fashion-mnist"
# Loaded datasets as tensors, shared by every process of this machine (see _tensor_cache_file).
TENSOR_CACHE_DIR = "~/.cache/alignfl/tensors"
TENSOR_CACHE_FORMAT = 1
"""Bumped whenever a loader's output changes (normalisation, splits), so older cache files are not read."""


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


@dataclass(frozen=True)
class ClientData:
    """One client's training split and its held-out local test split (labels of the training split possibly
    noisy, those of the test split never): what its local update trains and scores on."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


Loader = Callable[[Path | None], ImageDataset]
MissingFiles = Callable[[Path | None], list[Path]]
Fingerprint = Callable[[Path | None], str | None]
"""What a loader's output depends on (its files' paths, sizes and times, a package version), as a string; None
when it cannot be told (files absent), which leaves the dataset out of the tensor cache."""


def _nothing_missing(data_root: Path | None) -> list[Path]:
    """For datasets that ship with an installed package."""
    return []


@dataclass(frozen=True)
class DataSource:
    """One data set: its loader ``(data_root) -> ImageDataset`` and what it declares of itself.

    ``input_shape`` and ``num_classes`` are declared so that configs can be
    validated and models built without reading any data; ``missing_files``
    lists the required files that are absent, for a cheap check before training;
    with a ``fingerprint`` the loaded tensors are kept in the machine's tensor
    cache, so other processes read them instead of loading again.
    """

    name: str
    load: Loader
    input_shape: tuple[int, int, int]
    num_classes: int
    missing_files: MissingFiles = _nothing_missing
    fingerprint: Fingerprint | None = None


DATASETS: Registry[DataSource] = Registry("dataset")
"""Every data set, registered by this package's modules with ``DATASETS.register(DataSource(...))``."""


def list_datasets() -> list[str]:
    """Names accepted by ``load_dataset``."""
    return DATASETS.names()


def _resolve_root(data_root: str | Path | None) -> Path | None:
    """An absolute root, or None when unset (None or empty string)."""
    return Path(data_root).expanduser().resolve() if data_root else None


def dataset_info(name: str) -> tuple[tuple[int, int, int], int]:
    """``(input_shape, num_classes)`` of a registered dataset, without loading it."""
    entry = DATASETS.get(name)
    return entry.input_shape, entry.num_classes


def load_dataset(name: str, data_root: str | None = None) -> ImageDataset:
    """Load a dataset once per process (cached on its name and resolved root)."""
    DATASETS.get(name)
    return _load_cached(name, _resolve_root(data_root))


@functools.lru_cache(maxsize=4)
def _load_cached(name: str, root: Path | None) -> ImageDataset:
    entry = DATASETS.get(name)
    fingerprint = entry.fingerprint(root) if entry.fingerprint is not None else None
    path = _tensor_cache_file(name, root, fingerprint) if fingerprint is not None else None
    dataset = _read_tensor_cache(path, name, entry.num_classes) if path is not None else None
    if dataset is None:
        dataset = entry.load(root)
        if path is not None:
            _write_tensor_cache(path, dataset)
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
    if DATASETS.get(name).missing_files(_resolve_root(data_root)):
        load_dataset(name, data_root)


def _tensor_cache_file(name: str, root: Path | None, fingerprint: str) -> Path:
    """The tensor-cache file of one dataset, named by a hash of what its tensors depend on.

    Why a tensor cache: every ClientApp process of a deployment (Flower starts one per message) and every Ray
    worker would otherwise parse the files again (a second for Fashion-MNIST's gzip'd IDX files, more for
    scikit-learn's digits, mostly its import); a memory-mapped tensor file opens in milliseconds.
    """
    key = repr((name, str(root), fingerprint, TENSOR_CACHE_FORMAT)).encode()
    return Path(TENSOR_CACHE_DIR).expanduser() / f"{name}-{hashlib.sha256(key).hexdigest()[:32]}.pt"


def _read_tensor_cache(path: Path, name: str, num_classes: int) -> ImageDataset | None:
    """The cached tensors (memory-mapped, copy on write), or None when absent or unreadable."""
    try:
        tensors = torch.load(path, mmap=True, weights_only=True)
        return ImageDataset(
            name, tensors["train_x"], tensors["train_y"], tensors["test_x"], tensors["test_y"], num_classes
        )
    except (OSError, RuntimeError, KeyError, TypeError, ValueError, EOFError):
        return None  # absent, truncated or from another format: loaded from the source again


def _write_tensor_cache(path: Path, dataset: ImageDataset) -> None:
    tensors = {key: getattr(dataset, key) for key in ("train_x", "train_y", "test_x", "test_y")}
    store_atomically(path, path.with_suffix(f".{os.getpid()}.tmp"), lambda partial: torch.save(tensors, partial))


def store_atomically(path: Path, partial: Path, save: Callable[[Path], None]) -> None:
    """``save`` to ``partial``, then rename it to ``path``: a concurrent reader sees the whole file or none. Best
    effort: a read-only home only costs recomputing what the file would have held."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save(partial)
        os.replace(partial, path)
    except OSError:
        pass


import_modules(__name__, __path__)  # last: the modules import the names above
