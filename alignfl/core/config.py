"""The settings every run has, whatever its algorithm and model, and the composed :class:`RunConfig`.

The common settings come in sections (:data:`SECTIONS`): the run itself, training,
data and PANs. Each is a settings class of :mod:`alignfl.plugins.options`, so its defaults,
help and checks are written once, here; the algorithm's settings, the model's
options and the partitioner's settings are declared by the algorithm's module, the
model's module and :mod:`alignfl.core.partitioning.partitioners` the same way.
:class:`RunConfig` holds the common settings as fields and the chosen algorithm's
settings, model's options and partitioner's settings as three objects; the schema that
builds it from run-config keys lives with the registries it needs (:mod:`alignfl.fl_app.config`).
The partitioners' keys sit in the Hydra ``data`` section (``data.dirichlet_alpha``).

Hydra paths are ``<section>.<leaf>``; a leaf is the field name with the section's name
left off where the field starts with it (``data.root`` is ``data_root``, run-config key
``data-root``; ``pan.mode`` is ``pan_mode``, key ``pan-mode``), so paths and keys map
onto each other mechanically (:func:`hydra_leaf`, :func:`key_of_path`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignfl.core.data import dataset_info, list_datasets
from alignfl.core.data.label_noise import LABEL_NOISE_KINDS
from alignfl.core.partitioning.partitioners import PARTITIONERS, Split, check_partitioning, list_partitioners
from alignfl.models.init import INITS
from alignfl.models.pan import PanSettings
from alignfl.plugins.options import (
    NoOptions,
    Setting,
    check_settings,
    choice,
    non_negative,
    option,
    option_from,
    positive,
    refuse,
    settings_fields,
    source_settings,
    unit_interval,
)

DEVICE_CHOICES = ("auto", "cpu", "cuda")
SERVER_WEIGHTINGS = ("examples", "uniform")
TRACKING_CHOICES = ("tensorboard", "mlflow", "both", "none")
CLIENT_INITS = ("global", "independent")
REPAIR_CHOICES = ("off", "on")


MLFLOW_SCHEMES = ("databricks", "file", "http", "https", "mssql", "mysql", "postgresql", "sqlite")
"""The schemes of MLflow's own tracking stores (a database's may name its driver: ``postgresql+psycopg2``)."""


def _mlflow_uri(value: str) -> bool:
    """An MLflow tracking URI of a known scheme; a file or SQLite store by absolute path (the app runs from a
    copy)."""
    if not value:
        return True
    scheme, _, rest = value.partition(":")
    engine = scheme.split("+", 1)[0]
    if engine not in MLFLOW_SCHEMES or ("+" in scheme and engine in ("databricks", "file", "http", "https")):
        return False
    if engine == "sqlite":
        return rest.startswith("////")
    if engine == "file":
        return rest.startswith("///")
    return rest.startswith("//") or value == "databricks"


def _widths(value: str) -> bool:
    """Comma-separated finite numbers > 0, or empty."""
    try:
        return all(positive(float(item)) for item in value.split(",")) if value.strip() else True
    except ValueError:
        return False


def _absolute_or_empty(what: str) -> dict[str, Any]:
    return {
        "check": lambda value: not value or Path(value).is_absolute(),
        "allowed": f"must be an absolute path ({what}), or empty",
    }


@dataclass(frozen=True)
class RunSection:
    """What runs, on what, where its results go."""

    strategy: str = option("fedavg", "the federated algorithm (listed below the tables)")
    model: str = option("mlp", "the network (listed below the tables)")
    dataset: str = choice("fashion-mnist", "the data set", list_datasets)
    seed: int = option(
        0, "seeds data splits, initialisation, sampling and every client's batches", lambda v: v >= 0, "must be >= 0"
    )
    device: str = option(
        "auto",
        "where clients and the server compute: auto (CUDA when present), cpu, cuda, cuda:<index>",
        lambda v: v in DEVICE_CHOICES or v.startswith("cuda:"),
        f"one of {list(DEVICE_CHOICES)} or 'cuda:<index>'",
    )
    client_widths: str = option(
        "",
        "width multiplier of each partition's model (times width-factor), cycled over partitions, e.g. "
        "0.25,0.5,1 (empty: every client at the global width); different widths need a strategy that takes them",
        _widths,
        "must be comma-separated numbers > 0, or empty",
    )
    global_width: float = option(
        0.0,
        "width multiplier of the global model (0: the widest of client-widths, or 1)",
        non_negative,
        "must be a finite number >= 0 (0: the widest client width)",
    )
    init: str = choice("default", "weight init after the model is built (default: as built; he: He-normal)", INITS)
    log_divergence: bool = option(False, "log per-layer weight divergence of the clients' models every round")
    log_units_moved: bool = option(
        False,
        "log per group the share of units each client's training moved (client-units-moved: weight matching of "
        "its model onto the model the round started from; needs a model with a permutation description)",
    )
    results_dir: str = option(
        "",
        "where run folders go (absolute; empty: $ALIGNFL_RESULTS, else ~/alignfl-results)",
        **_absolute_or_empty("the app runs from a copy in another directory"),
    )
    run_name: str = option(
        "",
        "the run folder's name (empty: strategy-model-dataset-time)",
        lambda v: "/" not in v and v not in (".", ".."),
        "must be a plain folder name",
    )
    resume_from: str = option(
        "",
        "an earlier run's folder (absolute) to continue from its checkpoint.pt",
        **_absolute_or_empty("the folder holding checkpoint.pt"),
    )
    tracking: str = choice(
        "tensorboard",
        "where each round's metrics also go: tensorboard (event files in the run "
        "folder), mlflow (an MLflow run; needs pip install 'alignfl[mlflow]'), both, or none",
        TRACKING_CHOICES,
    )
    mlflow_uri: str = option(
        "",
        "MLflow tracking URI for tracking=mlflow or both: sqlite:////abs/file.db, "
        "http://host:port, ... (empty: sqlite under the results folder)",
        _mlflow_uri,
        f"must be an MLflow tracking URI of a scheme in {list(MLFLOW_SCHEMES)} (sqlite:////absolute/path.db, "
        "file:///absolute/folder, http(s)://host:port, postgresql://..., databricks), or empty",
    )


@dataclass(frozen=True)
class TrainSection:
    """Rounds, local optimisation and participation."""

    num_server_rounds: int = option(10, "communication rounds", positive, "must be a positive integer")
    local_epochs: int = option(1, "local epochs per round", positive, "must be a positive integer")
    client_init: str = choice(
        "global",
        "what clients start round 1 from: global (the server's initial model, as in every later round) or "
        "independent (each client its own initialisation, seeded by seed and partition: the setting of one-shot "
        "merging and model fusion); later rounds start from the global model",
        CLIENT_INITS,
    )
    server_ensemble: bool = option(
        False,
        "the server also scores the clients' trained models of every round on the test split: their ensemble "
        "(mean softmax, server-ensemble), the best one (server-best-client) and their mean (server-client-mean)",
    )
    repair: str = choice(
        "off",
        "REPAIR (Jordan et al., ICLR 2023) after an aligning strategy merges: clients also send per-unit mean and std "
        "of their trained model's pre-activations on their training data; a second message asks them for the merged "
        "model's; the server rescales each merged unit to the examples-weighted mean of the clients' statistics",
        REPAIR_CHOICES,
    )
    batch_size: int = option(64, "local mini-batch size", positive, "must be a positive integer")
    lr: float = option(0.05, "client learning rate", positive, "must be a finite number > 0")
    lr_decay: float = option(
        1.0, "client lr is lr * lr-decay^(round - 1)", unit_interval, "must lie in (0, 1] (1 is no decay)"
    )
    lr_warmup_rounds: int = option(
        0,
        "rounds of linear lr warm-up: round r trains at lr * min(1, r / this) (0: none; the PANs authors warm up)",
        lambda v: v >= 0,
        "must be an integer >= 0",
    )
    momentum: float = option(0.9, "client SGD momentum", lambda v: 0 <= v < 1, "must lie in [0, 1)")
    weight_decay: float = option(1e-5, "client SGD weight decay", non_negative, "must be a finite number >= 0")
    server_weighting: str = choice(
        "examples",
        "how the server weighs client models: by their example counts "
        "(FedAvg) or uniformly (the PANs authors' unweighted mean)",
        SERVER_WEIGHTINGS,
    )
    fraction_train: float = option(
        1.0, "share of the clients sampled for training each round", unit_interval, "must lie in (0, 1]"
    )
    fraction_evaluate: float = option(
        1.0, "share of the clients sampled for local evaluation each round", unit_interval, "must lie in (0, 1]"
    )
    evaluate_every: int = option(
        1,
        "rounds between the clients' local evaluations (the last round always has one)",
        positive,
        "must be a positive integer",
    )
    server_evaluate_every: int = option(
        1,
        "rounds between the server's evaluations of the global model on the test split (round 0 and the last "
        "round always have one)",
        positive,
        "must be a positive integer",
    )
    min_available_nodes: int = option(
        2,
        "nodes the first round waits for (later rounds use whoever is online)",
        positive,
        "must be a positive integer",
    )
    node_wait_timeout: float = option(
        300.0,
        "seconds the first round waits for min-available-nodes before it starts with the nodes connected",
        positive,
        "must be a finite number > 0",
    )
    round_timeout: float = option(
        3600.0,
        "seconds to wait for clients' replies each round; late ones are dropped",
        positive,
        "must be a finite number of seconds > 0",
    )


@dataclass(frozen=True)
class DataSection:
    """How the data set is split over clients."""

    data_root: str = option(
        "",
        "where the data set lives (absolute; empty: its default location)",
        **_absolute_or_empty("a torchvision-style root"),
    )
    partitioner: str = choice(
        "dirichlet",
        "how the training set is split over clients",
        list_partitioners,
    )
    train_size: int = option(
        0,
        "training samples partitioned, a seeded random subset (0: all)",
        lambda v: v >= 0,
        "must be an integer >= 0 (0: the whole training set)",
    )
    test_fraction: float = option(
        0.2, "share of each client's data kept for its local test split", lambda v: 0 < v < 1, "must lie in (0, 1)"
    )
    data_fraction: float = option(
        1.0,
        "share of each client's partition it keeps (before the test split)",
        unit_interval,
        "must lie in (0, 1] (1 keeps all)",
    )
    holdout_clients: int = option(
        0,
        "the last partitions never train; they score the global model as new clients",
        lambda v: v >= 0,
        "must be an integer >= 0",
    )
    label_noise: str = choice("none", "kind of noise put on clients' training labels", LABEL_NOISE_KINDS)
    label_noise_rate: float = option(
        0.0, "share of training labels changed", lambda v: 0 <= v < 1, "must lie in [0, 1)"
    )


@dataclass(frozen=True)
class PanSection:
    """Position-Aware Neurons on every hidden layer: e_j = A sin(2 pi T j / J). The fields are
    :class:`~alignfl.models.pan.PanSettings`'s, declared there (defaults, help, checks) and borrowed here."""

    pan_mode: str = option_from(PanSettings, "mode")
    pan_t: float = option_from(PanSettings, "period")
    pan_a: float = option_from(PanSettings, "amplitude")

    @property
    def pan(self) -> PanSettings:
        """The Position-Aware-Neuron settings every hidden layer of the model uses."""
        return source_settings(self, PanSettings)

    def pan_signature(self) -> dict[str, Any]:
        """The keys a client must share with the server: encodings are fixed, never averaged."""
        return {setting.key: getattr(self, setting.name) for setting in settings_fields(PanSection)}


SECTIONS: dict[str, type] = {"": RunSection, "train": TrainSection, "data": DataSection, "pan": PanSection}
"""Hydra section → the common settings it holds (``""``: the top level)."""
PARTITIONER_SECTION = "data"
"""The Hydra section that also holds every partitioner's settings (``data.dirichlet_alpha``)."""


@dataclass(frozen=True)
class RunConfig(RunSection, TrainSection, DataSection, PanSection):
    """Every setting of one run: the common ones as fields, plus the chosen algorithm's ``settings`` and the
    chosen model's ``model_options`` and the chosen partitioner's ``partitioner_settings`` (settings objects of
    those modules; built by :func:`alignfl.fl_app.config.parse_run_config`)."""

    settings: Any = NoOptions()
    model_options: Any = NoOptions()
    partitioner_settings: Any = None  # None: the chosen partitioner's defaults

    def __post_init__(self) -> None:
        if self.partitioner_settings is None and self.partitioner in list_partitioners():
            object.__setattr__(self, "partitioner_settings", PARTITIONERS.get(self.partitioner).settings())

    def partition_options(self) -> dict[str, Any]:
        """The keyword settings of :func:`alignfl.core.partitioning.partitions.partition_dataset`."""
        own = self.partitioner_settings
        return {"train_size": self.train_size, **{s.name: getattr(own, s.name) for s in settings_fields(type(own))}}

    def to_run_config(self) -> dict[str, Any]:
        """The hyphenated key → value mapping, as ``flwr run`` and the results folder store it."""
        return {setting.key: value for setting, value in self.items()}

    def items(self) -> list[tuple[Setting, Any]]:
        """Every setting of the run with its value: common, then the algorithm's, the model's, the partitioner's."""
        common = [(s, getattr(self, s.name)) for s in common_settings()]
        own = [
            (s, getattr(part, s.name))
            for part in (self.settings, self.model_options, self.partitioner_settings)
            for s in settings_fields(type(part))
        ]
        return common + own

    def replace(self, **changes: Any) -> RunConfig:
        """A checked copy with some common fields changed (field names, not keys)."""
        changed = dataclasses.replace(self, **changes)
        check_settings(changed)
        return changed

    def check(self) -> None:
        """Checks across fields (each field's own check has run)."""
        if self.holdout_clients >= self.min_available_nodes:
            raise refuse(
                "holdout-clients",
                self.holdout_clients,
                f"must be an integer in [0, min-available-nodes = {self.min_available_nodes}): some node must train",
            )
        if not isinstance(self.partitioner_settings, PARTITIONERS.get(self.partitioner).settings):
            raise TypeError(
                f"partitioner_settings {self.partitioner_settings!r} are not those of partitioner '{self.partitioner}'"
            )
        _, num_classes = dataset_info(self.dataset)
        check_partitioning(self.partitioner, self.partitioner_settings, Split(self.dataset, num_classes))


def common_settings() -> list[Setting]:
    """The common settings, section by section."""
    return [setting for section in SECTIONS.values() for setting in settings_fields(section)]


def section_of(key: str) -> str:
    """The Hydra section of a common run-config key or of a partitioner's key."""
    for section, settings in SECTIONS.items():
        if key in {s.key for s in settings_fields(settings)}:
            return section
    if key in {s.key for name in list_partitioners() for s in settings_fields(PARTITIONERS.get(name).settings)}:
        return PARTITIONER_SECTION
    raise KeyError(key)


def hydra_leaf(section: str, key: str) -> str:
    """The leaf name of run-config ``key`` in Hydra ``section``: underscores, the section's name left off."""
    leaf = key.removeprefix(f"{section}-") if section else key
    return leaf.replace("-", "_")


def key_of_path(section: str, leaf: str, keys: set[str]) -> str | None:
    """The run-config key (among ``keys``) of Hydra path ``<section>.<leaf>``, or None."""
    plain = leaf.replace("_", "-")
    for key in (f"{section}-{plain}" if section else plain, plain):
        if key in keys:
            return key
    return None


RESULTS_ENV = "ALIGNFL_RESULTS"
"""The environment variable that moves the default results root (``conf/config.yaml``'s Hydra folders read it too)."""


def default_results_root() -> Path:
    """The one folder every kind of run writes under by default: ``$ALIGNFL_RESULTS`` or ``~/alignfl-results``.

    The launcher, ``deploy``, a plain ``flwr run``, sweeps (``<root>/sweeps/``) and the analysis tools
    (``<root>/analysis/``) share it, so results are in one place whatever started the run.
    """
    given = os.environ.get(RESULTS_ENV)
    return Path(given).expanduser().resolve() if given else Path.home() / "alignfl-results"


def results_root(config: RunConfig) -> Path:
    """Where run folders go: ``results-dir``, else :func:`default_results_root`."""
    return Path(config.results_dir) if config.results_dir else default_results_root()
