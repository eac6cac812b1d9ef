"""``fixed-pairs``: SuPerFed's pathological split, on flwr-datasets' :class:`~flwr_datasets.partitioner.Partitioner`.

It lives in its own module because flwr-datasets takes seconds to import: only a process that
uses this partitioner imports it (see :mod:`alignfl.core.partitioning.partitioners`).

:class:`FixedPairPartitioner` is SuPerFed's pathological split (Hahn, Jeong and Lee,
"Connecting Low-Loss Subspace for Personalized Federated Learning", KDD 2022; its authors'
code: github.com/vaseline555/SuPerFed, ``src/utils.py``, ``split_data`` with
``split_type == 'pathological'``; shard sizes in ``commands/non-IID/pathological.sh``).
What that code does: sort the whole training set by label, cut it into ``2K``
equal shards of ``N / (2K)`` samples (it asserts exactly two shards per client:
600, 300 and 60 for MNIST and 500, 250 and 50 for CIFAR-10 at K = 50, 100 and
500), and deal shard ``i`` to client ``i mod K``. Every sample is used once, none
twice (no replacement), and nothing is random. With 10 classes of equal size,
client ``k`` thus holds shards ``k`` and ``K + k``: classes ``k // (K/5)`` and
``5 + k // (K/5)`` ({k//10, 5 + k//10} at K = 50, {k//20, 5 + k//20} at K = 100,
{k//100, 5 + k//100} at K = 500), ``N / (2K)`` samples of each.

Where this class deviates, and why:

* The pair rule is applied to the classes themselves instead of to positions in
  the label-sorted data. The authors' shards only match classes when every class
  has exactly ``N / 10`` samples (CIFAR-10, Fashion-MNIST); on MNIST (5,421 to
  6,742 per class) many shards straddle two classes, so many clients there hold
  three classes and unequal counts. Here every client holds exactly its two
  classes, the same number of samples of each.
* ``samples_per_client`` sets the size; by default it is the largest even size
  every class pool can give all its holders (the authors' ``N / K`` on balanced
  data), so on unbalanced data some samples of the larger classes are unused.
* Each class's samples are shuffled by ``seed`` before being cut into shards; the
  authors cut in ``np.argsort`` order (arbitrary within a class, fixed).
* Any even number of classes ``C`` works: ``K`` must be a multiple of ``C / 2``
  (5 for 10 classes), and client ``k`` holds classes ``k // s`` and
  ``C/2 + k // s`` (indices into the sorted labels) with ``s = 2K / C`` holders
  per class, which is the authors' dealing with ``C`` balanced classes.
"""

from __future__ import annotations

import numbers

import numpy as np
from datasets import Dataset
from flwr_datasets.partitioner import Partitioner

from alignfl.plugins.options import require_int


def fixed_pair(partition_id: int, num_partitions: int, num_classes: int) -> tuple[int, int]:
    """The two class indices (into the sorted labels) that client ``partition_id`` holds.

    ``(k // s, C/2 + k // s)`` with ``s = 2K / C`` clients per class: shards ``k`` and
    ``K + k`` of the authors' label-sorted dealing.
    """
    holders = _holders_per_class(num_partitions, num_classes)
    return partition_id // holders, num_classes // 2 + partition_id // holders


def _holders_per_class(num_partitions: int, num_classes: int) -> int:
    """``s = 2K / C``, or a ValueError naming what is allowed."""
    if num_classes < 2 or num_classes % 2:
        raise ValueError(f"FixedPairPartitioner needs an even number of classes (>= 2), got {num_classes}")
    half = num_classes // 2
    if num_partitions % half:
        raise ValueError(
            f"num_partitions must be a multiple of {half} (half the {num_classes} classes, so that "
            f"every class has the same number of holders), got {num_partitions}"
        )
    return num_partitions // half


class FixedPairPartitioner(Partitioner):
    """SuPerFed's pathological split: client ``k`` holds two fixed classes, equally many samples of each.

    Parameters
    ----------
    num_partitions : int
        ``K``, a multiple of half the number of classes (of 5 for 10 classes).
    samples_per_client : int, optional
        An even number >= 2, split equally between the two classes. ``None``: the
        largest even size that every class pool can give to each of its holders.
    seed : int
        Shuffles each class's samples before they are cut into shards.
    partition_by : str
        The label column.

    Raises
    ------
    ValueError
        Naming the parameter and what is allowed: here for a bad type or range, on the
        first :meth:`load_partition` for settings the dataset cannot meet (an odd
        number of classes, ``K`` not a multiple of half of them, more samples
        per client than the smallest class can give all its holders).
    """

    def __init__(
        self, num_partitions: int, samples_per_client: int | None = None, seed: int = 42, partition_by: str = "label"
    ) -> None:
        super().__init__()
        self._num_partitions = require_int("num_partitions", num_partitions, 1)
        if samples_per_client is not None:
            samples_per_client = require_int("samples_per_client", samples_per_client, 2)
            if samples_per_client % 2:
                raise ValueError(
                    f"samples_per_client must be even (half from each of the two classes) or None, "
                    f"got {samples_per_client}"
                )
        self._samples_per_client = samples_per_client
        self._seed = require_int("seed", seed, 0)
        self._partition_by = partition_by
        self._partitions: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    def load_partition(self, partition_id: int) -> Dataset:
        """Client ``partition_id``'s rows: its first class's share, then its second's."""
        if not (isinstance(partition_id, numbers.Integral) and 0 <= partition_id < self._num_partitions):
            raise ValueError(f"partition_id must be in [0, {self._num_partitions - 1}], got {partition_id!r}")
        if self._partitions is None:
            self._partitions = self._split()
        return self.dataset.select(self._partitions[int(partition_id)])

    def _split(self) -> list[np.ndarray]:
        """Every client's row indices, computed once."""
        labels = np.asarray(self.dataset[self._partition_by][:])
        classes = np.unique(labels)
        holders = _holders_per_class(self._num_partitions, len(classes))
        rng = np.random.default_rng(self._seed)
        pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
        per_class = self._per_class(pools, classes, holders)
        shards = [pool[: holders * per_class].reshape(holders, per_class) for pool in pools]
        parts = []
        for k in range(self._num_partitions):
            first, second = fixed_pair(k, self._num_partitions, len(classes))
            parts.append(np.concatenate([shards[first][k % holders], shards[second][k % holders]]))
        return parts

    def _per_class(self, pools: list[np.ndarray], classes: np.ndarray, holders: int) -> int:
        """Samples of each class per client: half of ``samples_per_client``, checked against the smallest pool."""
        smallest = min(range(len(pools)), key=lambda c: len(pools[c]))
        size = len(pools[smallest])
        most = size // holders
        if most == 0:
            raise ValueError(
                f"num_partitions={self._num_partitions} gives every class {holders} clients, but class "
                f"{classes[smallest]!r} has only {size} samples; allowed: num_partitions <= "
                f"{size * (len(classes) // 2)}"
            )
        wanted = most if self._samples_per_client is None else self._samples_per_client // 2
        if wanted > most:
            raise ValueError(
                f"samples_per_client={self._samples_per_client} is more than the data hold: every class "
                f"is shared by {holders} clients and class {classes[smallest]!r} has {size} samples; "
                f"allowed: None or an even number in [2, {2 * most}]"
            )
        return wanted
