"""core/partitioners.py: SuPerFed's fixed-pair pathological split on a small synthetic dataset."""

from __future__ import annotations

import numpy as np
import pytest
from datasets import Dataset
from flwr_datasets.partitioner import Partitioner

from core.partitioners import FixedPairPartitioner, fixed_pair

PER_CLASS = 60  # 10 classes x 60 rows: 12 per client at K = 50, as MNIST's 1,200 is N / K


def _dataset(counts: list[int], seed: int = 0) -> Dataset:
    """Rows of ``counts[c]`` samples of class ``c``, in shuffled order, with their row number in ``index``."""
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(len(counts)), counts))
    return Dataset.from_dict({"label": labels, "index": np.arange(len(labels))})


def _partitions(num_partitions: int, counts: list[int] | None = None, **kwargs) -> list[Dataset]:
    partitioner = FixedPairPartitioner(num_partitions, **kwargs)
    partitioner.dataset = _dataset(counts or [PER_CLASS] * 10)
    return [partitioner.load_partition(k) for k in range(num_partitions)]


def _authors_classes(labels: np.ndarray, num_partitions: int) -> list[set[int]]:
    """The authors' dealing: sort by label, cut 2K equal shards, shard i to client i mod K."""
    shards = np.array_split(np.sort(labels), 2 * num_partitions)
    return [set(shards[k].tolist()) | set(shards[num_partitions + k].tolist()) for k in range(num_partitions)]


def test_client_k_of_fifty_holds_classes_k_div_10_and_5_plus_k_div_10():
    for k, part in enumerate(_partitions(50)):
        assert set(part["label"][:]) == {k // 10, 5 + k // 10}


@pytest.mark.parametrize("num_partitions", [5, 50, 100, 500])
def test_pairs_match_the_authors_dealing_on_balanced_data(num_partitions):
    labels = np.repeat(np.arange(10), 100)
    holders = num_partitions // 5
    expected = [{k // holders, 5 + k // holders} for k in range(num_partitions)]
    assert _authors_classes(labels, num_partitions) == expected
    assert [set(fixed_pair(k, num_partitions, 10)) for k in range(num_partitions)] == expected


def test_equal_samples_per_class_and_the_authors_size_by_default():
    for part in _partitions(50):
        assert np.unique(np.asarray(part["label"][:]), return_counts=True)[1].tolist() == [6, 6]
    sizes = {len(part) for part in _partitions(10, samples_per_client=20)}
    assert sizes == {20}


def test_default_size_follows_the_smallest_class():
    counts = [PER_CLASS] * 10
    counts[7] = 25  # shared by 10 clients at K = 50: 2 each
    parts = _partitions(50, counts)
    assert {len(part) for part in parts} == {4}
    assert all(np.unique(np.asarray(p["label"][:]), return_counts=True)[1].tolist() == [2, 2] for p in parts)


def test_partitions_are_disjoint_and_come_from_the_dataset():
    parts = _partitions(50)
    rows = np.concatenate([np.asarray(part["index"][:]) for part in parts])
    assert len(rows) == len(set(rows.tolist())) == 600
    dataset = _dataset([PER_CLASS] * 10)
    for part in parts:
        assert np.array_equal(np.asarray(dataset["label"][:])[np.asarray(part["index"][:])],
                              np.asarray(part["label"][:]))


def test_deterministic_by_seed():
    def rows(seed: int) -> list[list[int]]:
        return [part["index"][:] for part in _partitions(50, seed=seed)]

    assert rows(3) == rows(3)
    assert rows(3) != rows(4)


def test_is_a_flower_partitioner():
    partitioner = FixedPairPartitioner(10)
    assert isinstance(partitioner, Partitioner) and partitioner.num_partitions == 10
    assert not partitioner.is_dataset_assigned()
    with pytest.raises(AttributeError):
        partitioner.load_partition(0)  # no dataset yet


@pytest.mark.parametrize(
    ("kwargs", "counts", "message"),
    [
        ({"num_partitions": 7}, None, r"num_partitions must be a multiple of 5 .* got 7"),
        ({"num_partitions": 0}, None, r"num_partitions must be an integer >= 1, got 0"),
        ({"num_partitions": 2.0}, None, r"num_partitions must be an integer"),
        ({"num_partitions": 10, "samples_per_client": 13}, None, r"samples_per_client must be even"),
        ({"num_partitions": 10, "samples_per_client": 0}, None, r"samples_per_client must be an integer >= 2"),
        ({"num_partitions": 10, "samples_per_client": 62}, None,
         r"samples_per_client=62 is more than .* allowed: None or an even number in \[2, 60\]"),
        ({"num_partitions": 10, "seed": -1}, None, r"seed must be an integer >= 0"),
        ({"num_partitions": 1000}, None, r"num_partitions=1000 .* allowed: num_partitions <= 300"),
        ({"num_partitions": 3}, [PER_CLASS] * 9, r"even number of classes"),
    ],
    ids=["k-not-multiple", "k-zero", "k-float", "odd-size", "size-zero", "too-many-samples", "seed",
         "too-many-clients", "odd-classes"],
)
def test_bad_settings_are_refused_naming_the_parameter(kwargs, counts, message):
    with pytest.raises(ValueError, match=message):
        _partitions(counts=counts, **kwargs)


def test_bad_partition_id_is_refused():
    partitioner = FixedPairPartitioner(5)
    partitioner.dataset = _dataset([PER_CLASS] * 10)
    with pytest.raises(ValueError, match=r"partition_id must be in \[0, 4\], got 5"):
        partitioner.load_partition(5)
