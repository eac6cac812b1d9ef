"""alignfl/core/partitioning: the partitioners with their settings and limits, the partition cache, each client's split;
and SuPerFed's fixed-pair split (alignfl/core/partitioning/fixed_pairs.py) on a small synthetic dataset.

Partitioning is tested mostly on scikit-learn's digits (1,437 training samples), with private caches.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset
from flwr_datasets.partitioner import Partitioner

from alignfl.core.data import DATASETS, load_dataset
from alignfl.core.partitioning import partitions
from alignfl.core.partitioning.fixed_pairs import FixedPairPartitioner, fixed_pair
from alignfl.core.partitioning.partitioners import (
    DIRICHLET_MIN_PARTITION_SIZE,
    FixedPairsSettings,
    Split,
    check_partitioning,
    list_partitioners,
)
from alignfl.core.partitioning.partitions import client_split, partition_dataset
from alignfl.fl_app.runtime import launch

pytestmark = [
    pytest.mark.usefixtures("private_tensor_cache", "private_partition_cache"),
    # pyarrow 25 deprecation raised inside ShardPartitioner's dataset.sort; not ours.
    pytest.mark.filterwarnings("ignore:Specifying null_placement:FutureWarning"),
    # DirichletPartitioner warns on each re-draw; the infeasible case is asserted on its error.
    pytest.mark.filterwarnings("ignore:The specified min_partition_size"),
]
needs_fashion_mnist = pytest.mark.skipif(
    bool(DATASETS.get("fashion-mnist").missing_files(None)),
    reason="Fashion-MNIST is not installed (dataset-fashion-mnist)",
)
DIGITS = 1437  # training samples of scikit-learn's digits


# --- the registry ----------------------------------------------------------------


def test_registry_lists_names() -> None:
    assert list_partitioners() == ["dirichlet", "fixed-pairs", "iid", "pathological", "shard"]


def test_unknown_partitioner_lists_allowed() -> None:
    with pytest.raises(ValueError, match="'quantity'") as info:
        partition_dataset("digits", None, "quantity", 2, 0)
    assert all(name in str(info.value) for name in list_partitioners())


def test_unknown_dataset_lists_allowed() -> None:
    with pytest.raises(ValueError, match="'imagenet'") as info:
        partition_dataset("imagenet", None, "iid", 2, 0)
    assert "'digits'" in str(info.value)


# --- partitions ------------------------------------------------------------------


def digest(parts: tuple[np.ndarray, ...]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(np.asarray(part, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:24]


@pytest.mark.parametrize(
    ("partitioner", "num_partitions", "seed", "options", "expected", "sizes", "first"),
    [
        ("iid", 7, 3, {}, "f21184829e2f4b30c1762ada", [206, 206, 205, 205], [184, 574, 312]),
        (
            "dirichlet",
            10,
            1,
            {"dirichlet_alpha": 0.3},
            "58e1ea82e1b34542bdd66ea1",
            [55, 192, 196, 164],
            [73, 1333, 303],
        ),
        ("dirichlet", 5, 0, {"train_size": 500}, "0f8f21e81cc2f105adcb25e2", [74, 96, 101, 126], [790, 117, 1308]),
        (
            "pathological",
            20,
            2,
            {"classes_per_client": 3},
            "86227c2f380c044adb02145e",
            [67, 73, 62, 75],
            [1286, 897, 1044],
        ),
        ("shard", 10, 4, {"shards_per_client": 3}, "274b2f56ad60a46345dc908c", [141, 141, 141, 141], [1083, 1042, 24]),
        ("fixed-pairs", 10, 0, {}, "f108b9747a900e8876952ec2", [138, 138, 138, 138], [781, 33, 1149]),
        (
            "fixed-pairs",
            5,
            1,
            {"samples_per_client": 40},
            "d9c166607c93a6d8599e2ec5",
            [40, 40, 40, 40],
            [1211, 1103, 1187],
        ),
    ],
)
def test_partitions_are_those_computed_before_partitioning_moved(
    partitioner, num_partitions, seed, options, expected, sizes, first
) -> None:
    """Pinned: the digests, sizes and first indices were computed by alignfl/core/data.py's partitioning before it moved
    to alignfl/core/partitioning (and its settings became settings classes)."""
    parts = partition_dataset("digits", None, partitioner, num_partitions, seed, **options)
    assert [len(part) for part in parts[:4]] == sizes and parts[0][:3].tolist() == first
    assert digest(parts) == expected


def label_sets(parts: tuple[np.ndarray, ...], labels: np.ndarray) -> list[set[int]]:
    return [set(labels[part].tolist()) for part in parts]


def assert_disjoint_within(parts: tuple[np.ndarray, ...], n: int) -> np.ndarray:
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined), "partitions overlap"
    assert joined.min() >= 0 and joined.max() < n
    return joined


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet", "pathological", "shard"])
def test_partitions_are_disjoint_and_read_only(partitioner: str) -> None:
    n = len(load_dataset("digits").train_y)
    parts = partition_dataset("digits", None, partitioner, 10, seed=1)
    assert len(parts) == 10 and all(len(part) > 0 and part.dtype == np.int64 for part in parts)
    joined = assert_disjoint_within(parts, n)
    if partitioner == "iid":
        assert len(joined) == n and max(map(len, parts)) - min(map(len, parts)) <= 1
    if partitioner == "shard":  # equal shards of floor(n / 20): fewer than 20 samples left out
        assert n - 20 < len(joined) <= n and len({len(part) for part in parts}) == 1
    with pytest.raises(ValueError):
        parts[0][0] = 0


def test_iid_is_label_balanced() -> None:
    labels = load_dataset("digits").train_y.numpy()
    parts = partition_dataset("digits", None, "iid", 4, seed=0)
    assert all(len(classes) == 10 for classes in label_sets(parts, labels))


@pytest.mark.parametrize("classes_per_client", [1, 2, 3])
def test_pathological_gives_exact_class_counts(classes_per_client: int) -> None:
    labels = load_dataset("digits").train_y.numpy()
    parts = partition_dataset("digits", None, "pathological", 20, 0, classes_per_client=classes_per_client)
    assert all(len(classes) == classes_per_client for classes in label_sets(parts, labels))
    # first-deterministic assignment: every class is used once clients >= classes
    assert set().union(*label_sets(parts, labels)) == set(range(10))


def mean_label_entropy(parts: tuple[np.ndarray, ...], labels: np.ndarray) -> float:
    entropies = []
    for part in parts:
        p = np.bincount(labels[part], minlength=10) / len(part)
        p = p[p > 0]
        entropies.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(entropies))


def test_dirichlet_small_alpha_is_more_skewed() -> None:
    labels = load_dataset("digits").train_y.numpy()
    skewed = partition_dataset("digits", None, "dirichlet", 10, 0, dirichlet_alpha=0.1)
    mild = partition_dataset("digits", None, "dirichlet", 10, 0, dirichlet_alpha=100.0)
    assert mean_label_entropy(skewed, labels) < mean_label_entropy(mild, labels) - 0.5
    assert mean_label_entropy(mild, labels) > 0.9 * np.log(10)


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet", "pathological", "shard"])
def test_partitions_are_a_pure_function_of_the_seed(partitioner: str) -> None:
    first = partition_dataset("digits", None, partitioner, 10, seed=3)
    # computed once per process
    assert partition_dataset("digits", None, partitioner, 10, seed=3) is first
    partitions._compute_partitions.cache_clear()
    again = partition_dataset("digits", None, partitioner, 10, seed=3)
    assert again is not first and all(np.array_equal(a, b) for a, b in zip(first, again))
    other = partition_dataset("digits", None, partitioner, 10, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_partitions_are_cached_on_disk_and_recomputed_when_unreadable(
    private_partition_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    partitions._compute_partitions.cache_clear()
    first = partition_dataset("digits", None, "pathological", 7, seed=5, classes_per_client=3)
    (stored,) = private_partition_cache.glob("*.npz")
    compute = partitions._partition_labels
    partitions._compute_partitions.cache_clear()
    monkeypatch.setattr(partitions, "_partition_labels", lambda *args: pytest.fail("recomputed despite the disk cache"))
    again = partition_dataset("digits", None, "pathological", 7, seed=5, classes_per_client=3)
    assert all(np.array_equal(a, b) and a.dtype == np.int64 and not a.flags.writeable for a, b in zip(again, first))

    monkeypatch.setattr(partitions, "_partition_labels", compute)
    partition_dataset("digits", None, "pathological", 7, seed=5, classes_per_client=2)
    assert len(list(private_partition_cache.glob("*.npz"))) == 2  # other settings, another file
    stored.write_bytes(b"not an npz file")
    partitions._compute_partitions.cache_clear()
    recomputed = partition_dataset("digits", None, "pathological", 7, seed=5, classes_per_client=3)
    assert all(np.array_equal(a, b) for a, b in zip(recomputed, first))
    assert not list(private_partition_cache.glob("*.tmp.npz"))


@needs_fashion_mnist
def test_dirichlet_small_alpha_many_clients_is_feasible() -> None:
    """Its speed is measured by benchmarks/partition_speed.py."""
    parts = partition_dataset("fashion-mnist", None, "dirichlet", 100, 0, dirichlet_alpha=0.1)
    assert len(parts) == 100 and min(map(len, parts)) >= DIRICHLET_MIN_PARTITION_SIZE
    assert len(assert_disjoint_within(parts, 60000)) == 60000


def test_infeasible_dirichlet_fails_naming_keys() -> None:
    # ~14 digits per client at alpha=0.1: some client is nearly always empty (how fast: benchmarks/partition_speed.py).
    with pytest.raises(ValueError, match="num-partitions=100, dirichlet-alpha=0.1"):
        partition_dataset("digits", None, "dirichlet", 100, 0, dirichlet_alpha=0.1)


def test_infeasible_pathological_names_keys() -> None:
    # 1,000 clients x 10 classes needs ~1,000 samples of each class; digits has ~144.
    with pytest.raises(ValueError, match="classes-per-client=10"):
        partition_dataset("digits", None, "pathological", 1000, 0, classes_per_client=10)


@pytest.mark.parametrize(
    ("partitioner", "kwargs", "key"),
    [
        ("dirichlet", {"num_partitions": 0}, "num-partitions"),
        ("dirichlet", {"num_partitions": 2.5}, "num-partitions"),
        ("dirichlet", {"dirichlet_alpha": 0.0}, "dirichlet-alpha"),
        ("dirichlet", {"dirichlet_alpha": -1.0}, "dirichlet-alpha"),
        ("dirichlet", {"dirichlet_alpha": float("nan")}, "dirichlet-alpha"),
        ("dirichlet", {"dirichlet_alpha": "0.5"}, "dirichlet-alpha"),
        ("pathological", {"classes_per_client": 0}, "classes-per-client"),
        ("pathological", {"classes_per_client": 11}, "classes-per-client"),
        ("shard", {"shards_per_client": 0}, "shards-per-client"),
        ("fixed-pairs", {"samples_per_client": 13}, "samples-per-client"),
        ("iid", {"seed": -1}, "seed"),
        ("iid", {"train_size": 1438}, "train-size"),
        ("iid", {"dirichlet_alpha": 0.5}, r"partitioner 'iid' takes no option\(s\) \['dirichlet_alpha'\]"),
    ],
)
def test_bad_partition_parameters_name_the_key(partitioner: str, kwargs: dict[str, object], key: str) -> None:
    args: dict[str, object] = {
        "dataset": "digits",
        "data_root": None,
        "partitioner": partitioner,
        "num_partitions": 10,
        "seed": 0,
    }
    with pytest.raises(ValueError, match=key):
        partition_dataset(**{**args, **kwargs})  # type: ignore[arg-type]


# --- client split --------------------------------------------------------------


def test_client_split_is_deterministic_disjoint_80_20() -> None:
    indices = np.arange(1000, 1100)
    train, test = client_split(indices, 0.2, seed=0, partition_id=5)
    assert (len(train), len(test)) == (80, 20)
    assert set(train).isdisjoint(test) and set(train) | set(test) == set(indices)
    again = client_split(indices, 0.2, seed=0, partition_id=5)
    assert np.array_equal(train, again[0]) and np.array_equal(test, again[1])
    other_client = client_split(indices, 0.2, seed=0, partition_id=6)
    assert not np.array_equal(test, other_client[1])
    other_seed = client_split(indices, 0.2, seed=1, partition_id=5)
    assert not np.array_equal(test, other_seed[1])


def test_client_split_keeps_a_training_sample() -> None:
    assert [len(part) for part in client_split(np.array([7]), 0.2, 0, 0)] == [1, 0]
    assert [len(part) for part in client_split(np.arange(2), 0.9, 0, 0)] == [1, 1]
    assert [len(part) for part in client_split(np.arange(10), 0.0, 0, 0)] == [10, 0]


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5])
def test_client_split_rejects_bad_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="test-fraction"):
        client_split(np.arange(10), fraction, 0, 0)


def test_client_split_keeps_a_seeded_share_then_splits_it() -> None:
    indices = np.arange(1000, 1100)
    train, test = client_split(indices, 0.2, seed=0, partition_id=5, keep_fraction=0.3)
    assert (len(train), len(test)) == (24, 6)
    full_train, full_test = client_split(indices, 0.2, seed=0, partition_id=5)
    kept = np.concatenate([test, train])  # the kept share is a prefix of the same shuffle
    assert np.array_equal(kept, np.concatenate([full_test, full_train])[:30])
    assert [len(part) for part in client_split(np.arange(10), 0.2, 0, 0, keep_fraction=0.01)] == [1, 0]


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, "0.5"])
def test_client_split_rejects_bad_keep_fraction(fraction: object) -> None:
    with pytest.raises(ValueError, match="data-fraction"):
        client_split(np.arange(10), 0.2, 0, 0, keep_fraction=fraction)


# --- settings the data cannot meet: refused before anything is split ----------------


def test_shard_refuses_more_shards_than_samples_naming_the_key() -> None:
    """500 clients x 10 shards of the 1,437 digits: flwr-datasets would divide by a shard size of 0."""
    with pytest.raises(
        ValueError,
        match=r"'shards-per-client' = 10 .*num-partitions = 500 .*5000 shards.*1437 "
        r"training samples.*allowed: shards-per-client \* num-partitions <= 1437, "
        r"here shards-per-client <= 2",
    ):
        partition_dataset("digits", None, "shard", 500, 0, shards_per_client=10)
    assert len(partition_dataset("digits", None, "shard", 500, 0, shards_per_client=2)) == 500  # the bound holds


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet", "pathological", "shard", "fixed-pairs"])
def test_more_partitions_than_samples_are_refused_naming_the_limit(partitioner: str) -> None:
    with pytest.raises(ValueError, match=f"num-partitions = 1440 is not allowed.*allowed: at most {DIGITS} partitions"):
        partition_dataset("digits", None, partitioner, 1440, 0)
    with pytest.raises(ValueError, match="num-partitions = 300 .*allowed: at most 200"):
        partition_dataset("digits", None, partitioner, 300, 0, train_size=200)


def test_fixed_pairs_refuses_a_count_that_is_not_a_multiple_of_half_the_classes() -> None:
    with pytest.raises(
        ValueError, match="num-partitions = 7 is not allowed with partitioner 'fixed-pairs'.*multiple of 5"
    ):
        partition_dataset("digits", None, "fixed-pairs", 7, 0)


def test_fixed_pairs_refuses_an_odd_number_of_classes_before_the_data_are_read() -> None:
    with pytest.raises(
        ValueError,
        match="'partitioner' = 'fixed-pairs' is not allowed: needs an even number of classes, and 'odd' has 9",
    ):
        check_partitioning("fixed-pairs", FixedPairsSettings(), Split("odd", 9))
    check_partitioning("fixed-pairs", FixedPairsSettings(), Split("even", 10))  # the count is not known yet


def test_fixed_pairs_refuses_more_samples_than_the_smallest_class_gives_naming_the_key() -> None:
    with pytest.raises(
        ValueError,
        match=r"partitioner 'fixed-pairs' cannot split.*num-partitions=10, "
        r"samples-per-client=400 .*allowed: None or an even number in \[2, \d+\]",
    ):
        partition_dataset("digits", None, "fixed-pairs", 10, 0, samples_per_client=400)


def test_the_launcher_refuses_an_infeasible_shard_split_before_starting(tmp_path: Path, capsys) -> None:
    """The issue's case: `./scripts/run.sh --num-supernodes 500 --run-config 'dataset="digits" partitioner="shard"
    shards-per-client=10'` ended in a ZeroDivisionError."""
    results = tmp_path / "results"
    code = launch.main(
        [
            "--num-supernodes",
            "500",
            "--run-config",
            f'dataset="digits" partitioner="shard" shards-per-client=10 results-dir="{results}"',
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "'shards-per-client' = 10" in err and "shards-per-client <= 2" in err
    assert "Traceback" not in err and not results.exists()


# --- fixed-pairs, the partitioner itself -------------------------------------------


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
        assert np.array_equal(
            np.asarray(dataset["label"][:])[np.asarray(part["index"][:])], np.asarray(part["label"][:])
        )


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
        (
            {"num_partitions": 10, "samples_per_client": 62},
            None,
            r"samples_per_client=62 is more than .* allowed: None or an even number in \[2, 60\]",
        ),
        ({"num_partitions": 10, "seed": -1}, None, r"seed must be an integer >= 0"),
        ({"num_partitions": 1000}, None, r"num_partitions=1000 .* allowed: num_partitions <= 300"),
        ({"num_partitions": 3}, [PER_CLASS] * 9, r"even number of classes"),
    ],
    ids=[
        "k-not-multiple",
        "k-zero",
        "k-float",
        "odd-size",
        "size-zero",
        "too-many-samples",
        "seed",
        "too-many-clients",
        "odd-classes",
    ],
)
def test_bad_settings_are_refused_naming_the_parameter(kwargs, counts, message):
    with pytest.raises(ValueError, match=message):
        _partitions(counts=counts, **kwargs)


def test_bad_partition_id_is_refused():
    partitioner = FixedPairPartitioner(5)
    partitioner.dataset = _dataset([PER_CLASS] * 10)
    with pytest.raises(ValueError, match=r"partition_id must be in \[0, 4\], got 5"):
        partitioner.load_partition(5)
