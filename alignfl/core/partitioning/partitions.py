"""The partitions of a data set, computed once, and each client's own train/test split of its partition.

A partition is a pure function of (dataset, data root, partitioner, its settings, number of
partitions, seed, train-size): all partitions of a split are computed together by the
partitioner (:mod:`alignfl.core.partitioning.partitioners`) and cached per process and on disk
(``~/.cache/alignfl/partitions``, keyed by a hash of the labels and settings).
:func:`client_split` then cuts one partition into the client's training and local test
samples, a pure function of the partition, the seed and the client.
"""

from __future__ import annotations

import functools
import hashlib
import numbers
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from alignfl.core.data import ImageDataset, dataset_info, load_dataset, store_atomically
from alignfl.core.partitioning.partitioners import (
    DIRICHLET_MIN_PARTITION_SIZE,
    PARTITIONERS,
    PATHOLOGICAL_CLASS_ASSIGNMENT,
    Split,
    check_partitioning,
)
from alignfl.plugins.options import build_settings, key_of, require_int, settings_fields

# Partitions computed once are stored here, shared by every process (see _partition_cache_file).
PARTITION_CACHE_DIR = "~/.cache/alignfl/partitions"


def partitioner_settings(partitioner: str, options: dict[str, Any]) -> Any:
    """The checked settings object of ``partitioner`` from keyword ``options`` (its settings fields)."""
    settings = PARTITIONERS.get(partitioner).settings
    names = [f.name for f in fields(settings)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"partitioner {partitioner!r} takes no option(s) {unknown}; allowed: {names}")
    return build_settings(settings, {key_of(settings, name): value for name, value in options.items()})


def partition_dataset(
    dataset: str,
    data_root: str | None,
    partitioner: str,
    num_partitions: int,
    seed: int,
    train_size: int = 0,
    **options: Any,
) -> tuple[np.ndarray, ...]:
    """Read-only index arrays into the train split, one per partition.

    A pure function of its arguments, cached per process: all partitions are computed in one go, so any
    number of clients costs one partitioning.

    Parameters
    ----------
    dataset : str
        A registered data set.
    data_root : str or None
        Where torchvision-style data sets are read from (None: the default root).
    partitioner : str
        A registered partitioner.
    num_partitions : int
        Number of partitions (clients), >= 1.
    seed : int
        Seeds the partitioning, >= 0.
    train_size : int, optional
        > 0: partition only that many training samples, a seeded random subset (the FedMA study's
        10,000-image MNIST subset); 0 (default) uses all.
    **options
        The partitioner's settings (field names of its settings class; unset ones take their defaults).

    Returns
    -------
    tuple of numpy.ndarray
        One read-only array of train-split indices per partition.

    Raises
    ------
    ValueError
        For settings the data cannot meet, naming the keys and what is allowed, before anything is split.
    """
    _, num_classes = dataset_info(dataset)
    settings = partitioner_settings(partitioner, options)
    num_partitions = require_int("num-partitions", num_partitions, 1)
    seed = require_int("seed", seed, 0)
    images = load_dataset(dataset, data_root)
    train_size = require_int("train-size", train_size, 0, len(images.train_y))
    check_partitioning(
        partitioner, settings, Split(dataset, num_classes, train_size or len(images.train_y), num_partitions)
    )
    return _compute_partitions(images, partitioner, settings, num_partitions, seed, train_size)


@functools.lru_cache(maxsize=8)
def _compute_partitions(
    images: ImageDataset, partitioner: str, settings: Any, num_partitions: int, seed: int, train_size: int
) -> tuple[np.ndarray, ...]:
    """Keyed on the loaded data set itself (one object per data set and root, see
    :func:`alignfl.core.data.load_dataset`)."""
    labels = images.train_y.numpy()
    key = (partitioner, settings, num_partitions, seed, train_size)
    path = _partition_cache_file(labels, key)
    parts = _read_partition_cache(path, num_partitions)
    if parts is None:
        parts = _partition_labels(labels, images.name, partitioner, settings, num_partitions, seed, train_size)
        _write_partition_cache(path, parts)
    for part in parts:
        part.flags.writeable = False  # shared through the cache
    return parts


def _partition_cache_file(labels: np.ndarray, key: tuple[Any, ...]) -> Path:
    """The disk-cache file of one partitioning, named by a hash of everything it depends on.

    Why a disk cache: every simulation process (each Ray actor of each run) would
    otherwise import flwr-datasets and partition again, tens of seconds on a small
    CPU. The key holds the training labels themselves, the partitioner and its
    settings, and the flwr-datasets version, so a changed input is never served stale.
    """
    from importlib.metadata import version

    digest = hashlib.sha256(labels.tobytes())
    digest.update(
        repr((key, PATHOLOGICAL_CLASS_ASSIGNMENT, DIRICHLET_MIN_PARTITION_SIZE, version("flwr-datasets"))).encode()
    )
    return Path(PARTITION_CACHE_DIR).expanduser() / f"{digest.hexdigest()[:32]}.npz"


def _read_partition_cache(path: Path, num_partitions: int) -> tuple[np.ndarray, ...] | None:
    """The cached partitions, or None when the file is absent or unreadable (then they are recomputed)."""
    try:
        with np.load(path) as stored:
            return tuple(np.array(stored[f"p{i}"], dtype=np.int64) for i in range(num_partitions))
    except (OSError, KeyError, ValueError):
        return None


def _write_partition_cache(path: Path, parts: tuple[np.ndarray, ...]) -> None:
    store_atomically(
        path,
        path.with_suffix(f".{os.getpid()}.tmp.npz"),
        lambda partial: np.savez(partial, **{f"p{i}": part for i, part in enumerate(parts)}),
    )


def _partition_labels(
    labels: np.ndarray, dataset: str, partitioner: str, settings: Any, num_partitions: int, seed: int, train_size: int
) -> tuple[np.ndarray, ...]:
    """Run the flwr-datasets partitioner over the labels (the work the caches save)."""
    from datasets import Dataset

    # Shuffle rows by the seed: IidPartitioner cuts contiguous blocks, and the
    # label partitioners take each class's samples in row order.
    order = np.random.default_rng(seed).permutation(len(labels))[: train_size or None]
    split = PARTITIONERS.get(partitioner).build(settings, num_partitions, seed)
    split.dataset = Dataset.from_dict({"label": labels[order], "index": order})
    try:
        return tuple(np.asarray(split.load_partition(pid)["index"][:], dtype=np.int64) for pid in range(num_partitions))
    except ValueError as err:  # an infeasible combination that only the seeded draw shows
        given = ", ".join(
            [
                f"num-partitions={num_partitions}",
                *(f"{s.key}={getattr(settings, s.name)}" for s in settings_fields(type(settings))),
            ]
        )
        raise ValueError(
            f"partitioner {partitioner!r} cannot split {dataset}'s {len(order)} training samples "
            f"with {given} (seed={seed}); change these settings. The partitioner said: {err}"
        ) from err


def client_split(
    indices: np.ndarray, test_fraction: float, seed: int, partition_id: int, keep_fraction: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle one partition, keep a share of it, and split that into (train, local test).

    The generator is seeded by (seed, partition_id), so each client gets its own
    split, the same in every round and process. ``keep_fraction`` (run-config
    ``data-fraction``) keeps the first round(n * keep_fraction) shuffled samples, at
    least one: a random subset of every client's data, so experiments shrink without
    changing which classes a client holds. The test part has round(m * test_fraction)
    of the m kept samples, but at least one sample stays for training.
    """
    if not isinstance(test_fraction, numbers.Real) or not 0 <= test_fraction < 1:
        raise ValueError(f"test-fraction must be a number in [0, 1), got {test_fraction!r}")
    if not isinstance(keep_fraction, numbers.Real) or not 0 < keep_fraction <= 1:
        raise ValueError(f"data-fraction must be a number in (0, 1], got {keep_fraction!r}")
    rng = np.random.default_rng([require_int("seed", seed, 0), require_int("partition-id", partition_id, 0)])
    shuffled = rng.permutation(np.asarray(indices))
    shuffled = shuffled[: max(round(len(shuffled) * keep_fraction), 1)]
    num_test = min(round(len(shuffled) * test_fraction), max(len(shuffled) - 1, 0))
    return shuffled[num_test:], shuffled[:num_test]
