"""The partitioners: how a training set may be split over clients, each with its settings and its limits.

A partitioner registers with one line, ``PARTITIONERS.register(Partitioning(...))``: its name
(run-config key ``partitioner``), a builder of a flwr-datasets
:class:`~flwr_datasets.partitioner.Partitioner`, its settings class (:mod:`alignfl.plugins.options`; the
run config, the Hydra ``data`` section and ``pyproject.toml`` are composed from it, as from an
algorithm's or a model's) and a check that refuses settings the data cannot meet, naming the
keys and what is allowed, before anything is split.

flwr-datasets (with pyarrow) takes seconds to import, so it is imported only inside the builders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from alignfl.plugins.options import NoOptions, option, positive, refuse
from alignfl.plugins.registry import Registry

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner

# Dirichlet: every client gets at least one sample, and otherwise the skew that
# alpha asks for (no self-balancing, see _dirichlet).
DIRICHLET_MIN_PARTITION_SIZE = 1
# Pathological: client i always holds class i % num_classes (so every class is
# used once there are at least as many clients as classes); the others are drawn
# at random from the seeded generator, as in Li et al. (2021), NIID-Bench.
PATHOLOGICAL_CLASS_ASSIGNMENT = "first-deterministic"


@dataclass(frozen=True)
class Split:
    """What is to be split, as a partitioner's check sees it; ``None``: not known yet (the run config is checked
    before the data are read and the nodes are counted)."""

    dataset: str
    num_classes: int
    num_samples: int | None = None
    num_partitions: int | None = None


@dataclass(frozen=True)
class Partitioning:
    """One way to split a training set.

    ``build(settings, num_partitions, seed)`` makes the flwr-datasets partitioner; ``settings`` is its settings
    class (a key may be shared by partitioners only with the same default); ``check(settings, split)`` raises
    :class:`alignfl.plugins.options.ConfigError` for settings the split cannot meet."""

    name: str
    build: Callable[[Any, int, int], Partitioner]
    settings: type = NoOptions
    check: Callable[[Any, Split], None] | None = None


PARTITIONERS: Registry[Partitioning] = Registry("partitioner")
"""Every partitioner, registered below."""


def list_partitioners() -> list[str]:
    """Names of every partitioner (values of run-config key ``partitioner``), sorted."""
    return PARTITIONERS.names()


def check_partitioning(partitioner: str, settings: Any, split: Split) -> None:
    """Refuse settings the split cannot meet, naming the keys and what is allowed; before the data are read,
    only what ``split`` knows is checked."""
    if split.num_samples is not None and split.num_partitions is not None and split.num_partitions > split.num_samples:
        raise ValueError(
            f"num-partitions = {split.num_partitions} is not allowed: every client needs a sample and "
            f"'{split.dataset}' has {split.num_samples} training samples to split; allowed: at most "
            f"{split.num_samples} partitions (clients), or a larger train-size"
        )
    check = PARTITIONERS.get(partitioner).check
    if check is not None:
        check(settings, split)


# --- iid -------------------------------------------------------------------------


def _iid(settings: NoOptions, num_partitions: int, seed: int) -> Partitioner:
    """Contiguous equal blocks; random because the rows are shuffled by the seed first."""
    from flwr_datasets.partitioner import IidPartitioner

    return IidPartitioner(num_partitions=num_partitions)


PARTITIONERS.register(Partitioning("iid", _iid))


# --- dirichlet -------------------------------------------------------------------


@dataclass(frozen=True)
class DirichletSettings:
    dirichlet_alpha: float = option(
        0.5, "Dirichlet concentration (smaller is more skewed)", positive, "must be > 0 (smaller is more skewed)"
    )


def _dirichlet(settings: DirichletSettings, num_partitions: int, seed: int) -> Partitioner:
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
        num_partitions=num_partitions,
        partition_by="label",
        alpha=settings.dirichlet_alpha,
        min_partition_size=DIRICHLET_MIN_PARTITION_SIZE,
        self_balancing=False,
        seed=seed,
    )


PARTITIONERS.register(Partitioning("dirichlet", _dirichlet, DirichletSettings))


# --- pathological ----------------------------------------------------------------


@dataclass(frozen=True)
class PathologicalSettings:
    classes_per_client: int = option(2, "classes each client holds", positive, "must be a positive integer")


def _pathological(settings: PathologicalSettings, num_partitions: int, seed: int) -> Partitioner:
    """Each client holds exactly classes-per-client classes, split evenly among their holders."""
    from flwr_datasets.partitioner import PathologicalPartitioner

    return PathologicalPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        num_classes_per_partition=settings.classes_per_client,
        class_assignment_mode=PATHOLOGICAL_CLASS_ASSIGNMENT,
        seed=seed,
    )


def _check_pathological(settings: PathologicalSettings, split: Split) -> None:
    """Whether a class has enough samples for all its holders depends on the seeded draw: flwr-datasets
    checks that (:func:`alignfl.core.partitioning.partitions.partition_dataset` names the keys)."""
    if settings.classes_per_client > split.num_classes:
        raise refuse(
            "classes-per-client",
            settings.classes_per_client,
            f"must be at most the number of classes of '{split.dataset}' ({split.num_classes})",
        )


PARTITIONERS.register(Partitioning("pathological", _pathological, PathologicalSettings, _check_pathological))


# --- shard -----------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSettings:
    shards_per_client: int = option(2, "label-sorted shards each client gets", positive, "must be a positive integer")


def _shard(settings: ShardSettings, num_partitions: int, seed: int) -> Partitioner:
    """McMahan et al. (2017): sort by label, cut equal shards, deal some to each client.

    Shards have floor(N / (clients * shards)) samples, so up to
    clients * shards - 1 samples are left out.
    """
    from flwr_datasets.partitioner import ShardPartitioner

    return ShardPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        num_shards_per_partition=settings.shards_per_client,
        seed=seed,
    )


def _check_shard(settings: ShardSettings, split: Split) -> None:
    """Every shard needs a sample: flwr-datasets would divide by a shard size of zero."""
    if split.num_samples is None or split.num_partitions is None:
        return
    shards = settings.shards_per_client * split.num_partitions
    if shards > split.num_samples:
        raise refuse(
            "shards-per-client",
            settings.shards_per_client,
            f"with num-partitions = {split.num_partitions} that is {shards} shards, but '{split.dataset}' "
            f"has {split.num_samples} training samples to cut them from (a shard would be empty); allowed: "
            f"shards-per-client * num-partitions <= {split.num_samples}, here shards-per-client <= "
            f"{split.num_samples // split.num_partitions}",
        )


PARTITIONERS.register(Partitioning("shard", _shard, ShardSettings, _check_shard))


# --- fixed-pairs -----------------------------------------------------------------


@dataclass(frozen=True)
class FixedPairsSettings:
    samples_per_client: int = option(
        0,
        "samples per client, half from each of its two classes (0: as many as the smallest class allows)",
        lambda v: v == 0 or (v >= 2 and v % 2 == 0),
        "must be 0 (as many as the smallest class allows) or an even number >= 2",
    )


def _fixed_pairs(settings: FixedPairsSettings, num_partitions: int, seed: int) -> Partitioner:
    """SuPerFed's authors' pathological split: client k holds the classes {k // (K/5), 5 + k // (K/5)} (for 10
    classes), in equal shares (:class:`alignfl.core.partitioning.fixed_pairs.FixedPairPartitioner`)."""
    from alignfl.core.partitioning.fixed_pairs import FixedPairPartitioner

    return FixedPairPartitioner(num_partitions, settings.samples_per_client or None, seed)


def _check_fixed_pairs(settings: FixedPairsSettings, split: Split) -> None:
    """Whether the smallest class can give every holder its share needs the labels: the partitioner checks that."""
    if split.num_classes % 2:
        raise refuse(
            "partitioner",
            "fixed-pairs",
            f"needs an even number of classes, and '{split.dataset}' has "
            f"{split.num_classes}; choose another partitioner",
        )
    half = split.num_classes // 2
    if split.num_partitions is not None and split.num_partitions % half:
        raise ValueError(
            f"num-partitions = {split.num_partitions} is not allowed with partitioner 'fixed-pairs': "
            f"it must be a multiple of {half} (half the {split.num_classes} classes of "
            f"'{split.dataset}', so that every class has as many holders)"
        )


PARTITIONERS.register(Partitioning("fixed-pairs", _fixed_pairs, FixedPairsSettings, _check_fixed_pairs))
