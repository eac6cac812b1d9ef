"""The one run-configuration schema.

`flwr run`'s run config (``[tool.flwr.app.config]``), the Hydra configs and the
in-process factories all become a :class:`RunConfig` through
:func:`parse_run_config`, so every entry point validates the same keys the same
way, before any data is loaded or any client trains.

Run-config keys are the dataclass field names with ``_`` written as ``-``
(``num_server_rounds`` is ``num-server-rounds``). The dataclass defaults are the
single source of the defaults; ``pyproject.toml`` repeats them because Flower
needs them there, and a test keeps the two equal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from models.pan import PAN_MODES, PanSettings

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A run-config value is wrong; the message names the key, the value and what is allowed."""


@dataclass(frozen=True)
class RunConfig:
    """Every setting of one run. See the README's table for what each key does."""

    strategy: str = "fedavg"
    model: str = "mlp"
    dataset: str = "fashion-mnist"
    data_root: str = ""
    num_server_rounds: int = 10
    local_epochs: int = 1
    batch_size: int = 64
    lr: float = 0.05
    lr_decay: float = 1.0
    momentum: float = 0.9
    weight_decay: float = 1e-5
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_available_nodes: int = 2
    holdout_clients: int = 0
    partitioner: str = "dirichlet"
    dirichlet_alpha: float = 0.5
    classes_per_client: int = 2
    shards_per_client: int = 2
    test_fraction: float = 0.2
    data_fraction: float = 1.0
    proximal_mu: float = 0.01
    server_lr: float = 1.0
    server_momentum: float = 0.9
    moon_mu: float = 1.0
    moon_tau: float = 0.5
    pan_mode: str = "off"
    pan_t: float = 1.0
    pan_a: float = 0.0
    psi_groups: int = 0
    psi_depth: int = 2
    width_factor: float = 1.0
    init: str = "default"
    superfed_mode: str = "mm"
    superfed_nu: float = 1.0
    superfed_mu: float = 0.01
    superfed_start: float = 0.5
    superfed_val_fraction: float = 0.1
    label_noise: str = "none"
    label_noise_rate: float = 0.0
    ditto_lambda: float = 0.1
    match_cost: str = "weight"
    match_reference: str = "global"
    match_iterations: int = 3
    retrain_epochs: int = 1
    log_divergence: bool = False
    seed: int = 0
    device: str = "auto"
    results_dir: str = ""
    run_name: str = ""
    resume_from: str = ""
    round_timeout: float = 3600.0

    @property
    def pan(self) -> PanSettings:
        """The Position-Aware-Neuron settings every hidden layer of the model uses."""
        return PanSettings(self.pan_mode, self.pan_t, self.pan_a)

    def pan_signature(self) -> dict[str, Any]:
        """The keys a client must share with the server: encodings are fixed, never averaged."""
        return {"pan-mode": self.pan_mode, "pan-t": self.pan_t, "pan-a": self.pan_a}

    def to_run_config(self) -> dict[str, Any]:
        """The hyphenated key → value mapping, as ``flwr run`` and the results folder store it."""
        return {field_to_key(f.name): getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes: Any) -> RunConfig:
        """A validated copy with some fields changed (field names, not keys)."""
        return parse_run_config({**self.to_run_config(), **{field_to_key(k): v for k, v in changes.items()}})


def field_to_key(name: str) -> str:
    """``num_server_rounds`` → ``num-server-rounds``."""
    return name.replace("_", "-")


def key_to_field(key: str) -> str:
    """``num-server-rounds`` → ``num_server_rounds``."""
    return key.replace("-", "_")


def default_run_config() -> dict[str, Any]:
    """The defaults, as run-config keys."""
    return RunConfig().to_run_config()


def _coerce(key: str, value: Any, kind: type) -> Any:
    """Convert a TOML/Hydra scalar to the field's type, refusing lossy or wrong-typed values."""
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"run-config key '{key}' = {value!r}: expected a value of type {kind.__name__}")


_FIELD_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


def parse_run_config(values: Mapping[str, Any] | None = None) -> RunConfig:
    """Build and validate a :class:`RunConfig` from run-config keys.

    Missing keys take their defaults; unknown keys, wrong types and out-of-range
    values raise :class:`ConfigError`.
    """
    values = dict(values or {})
    known = {field_to_key(f.name): f for f in fields(RunConfig)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown run-config key(s) {unknown}; allowed keys: {sorted(known)}")
    kwargs = {
        known[key].name: _coerce(key, value, _FIELD_TYPES[str(known[key].type)])
        for key, value in values.items()
    }
    config = RunConfig(**kwargs)
    validate(config)
    return config


def _check(condition: bool, key: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ConfigError(f"run-config key '{key}' = {value!r} is not allowed: {allowed}")


def _check_choice(key: str, value: str, choices: list[str] | tuple[str, ...]) -> None:
    _check(value in choices, key, value, f"choose one of {sorted(choices)}")


_POSITIVE_INTS = ("num-server-rounds", "local-epochs", "batch-size", "min-available-nodes",
                  "classes-per-client", "shards-per-client")
_UNIT_FRACTIONS = ("fraction-train", "fraction-evaluate")
_NON_NEGATIVE_FLOATS = ("lr", "momentum", "weight-decay", "proximal-mu", "server-lr", "server-momentum",
                        "pan-t", "pan-a")


def validate(config: RunConfig) -> None:
    """Refuse values no run could use, naming the key, the value and what is allowed."""
    # Imported here: the registries import this module's types.
    from core.data import dataset_info, list_datasets, list_partitioners
    from models import list_models
    from strategies import list_strategies

    values = config.to_run_config()
    _check_choice("strategy", config.strategy, list_strategies())
    _check_choice("model", config.model, list_models())
    _check_choice("dataset", config.dataset, list_datasets())
    _check_choice("partitioner", config.partitioner, list_partitioners())
    _check_choice("pan-mode", config.pan_mode, PAN_MODES)
    _check(config.device in DEVICE_CHOICES or config.device.startswith("cuda:"), "device",
           config.device, f"one of {list(DEVICE_CHOICES)} or 'cuda:<index>'")
    for key in _POSITIVE_INTS:
        _check(values[key] > 0, key, values[key], "must be a positive integer")
    for key in _UNIT_FRACTIONS:
        _check(0.0 < values[key] <= 1.0, key, values[key], "must lie in (0, 1]")
    for key in _NON_NEGATIVE_FLOATS:
        _check(math.isfinite(values[key]) and values[key] >= 0.0, key, values[key], "must be a finite number >= 0")
    _check(config.lr > 0.0, "lr", config.lr, "must be > 0")
    _check(math.isfinite(config.lr_decay) and 0.0 < config.lr_decay <= 1.0, "lr-decay", config.lr_decay,
           "must lie in (0, 1] (the client learning rate is lr · lr-decay^(round − 1); 1 is no decay)")
    _check(0 <= config.holdout_clients < config.min_available_nodes, "holdout-clients", config.holdout_clients,
           f"must be an integer in [0, min-available-nodes = {config.min_available_nodes}): some node must train")
    _check(config.momentum < 1.0, "momentum", config.momentum, "must be < 1")
    _check(config.server_momentum < 1.0, "server-momentum", config.server_momentum, "must be < 1")
    _check(math.isfinite(config.moon_mu) and config.moon_mu >= 0.0, "moon-mu", config.moon_mu,
           "must be a finite number >= 0")
    _check(math.isfinite(config.moon_tau) and config.moon_tau > 0.0, "moon-tau", config.moon_tau,
           "must be a finite number > 0")
    _check(math.isfinite(config.dirichlet_alpha) and config.dirichlet_alpha > 0.0, "dirichlet-alpha",
           config.dirichlet_alpha, "must be > 0 (smaller is more skewed)")
    _check(0.0 < config.test_fraction < 1.0, "test-fraction", config.test_fraction, "must lie in (0, 1)")
    _check(config.seed >= 0, "seed", config.seed, "must be >= 0")
    _check(not config.results_dir or Path(config.results_dir).is_absolute(), "results-dir",
           config.results_dir, "must be an absolute path (the app runs from a copy in another directory), "
           "or empty for ~/alignfl-results")
    _check(not config.data_root or Path(config.data_root).is_absolute(), "data-root", config.data_root,
           "must be an absolute path, or empty for the dataset's default location")
    _check("/" not in config.run_name and config.run_name not in (".", ".."), "run-name", config.run_name,
           "must be a plain folder name")
    _check(not config.resume_from or Path(config.resume_from).is_absolute(), "resume-from", config.resume_from,
           "must be the absolute path of an earlier run's folder (the one holding checkpoint.pt), or empty")
    _check(math.isfinite(config.round_timeout) and config.round_timeout > 0.0, "round-timeout",
           config.round_timeout, "must be a finite number of seconds > 0")
    _, num_classes = dataset_info(config.dataset)
    _check(config.classes_per_client <= num_classes, "classes-per-client", config.classes_per_client,
           f"must be at most the number of classes of '{config.dataset}' ({num_classes})")
    from core.alignment import list_costs  # matched/fedma keys (strategies/matched.py, fedma.py)
    from strategies.matched import MATCH_REFERENCES

    _check_choice("match-cost", config.match_cost, list_costs())
    _check_choice("match-reference", config.match_reference, MATCH_REFERENCES)
    _check(config.match_iterations >= 1, "match-iterations", config.match_iterations, "must be an integer >= 1")
    _check(config.retrain_epochs >= 1, "retrain-epochs", config.retrain_epochs, "must be an integer >= 1")
    from core.label_noise import LABEL_NOISE_KINDS  # superfed, label-noise and ditto keys
    from strategies.superfed import SUPERFED_MODES

    _check_choice("superfed-mode", config.superfed_mode, SUPERFED_MODES)
    for key in ("superfed-nu", "superfed-mu"):
        _check(math.isfinite(values[key]) and values[key] >= 0.0, key, values[key], "must be a finite number >= 0")
    _check(0.0 <= config.superfed_start <= 1.0, "superfed-start", config.superfed_start,
           "must lie in [0, 1] (the fraction of num-server-rounds before mixing starts)")
    _check(0.0 <= config.superfed_val_fraction < 1.0, "superfed-val-fraction", config.superfed_val_fraction,
           "must lie in [0, 1)")
    _check_choice("label-noise", config.label_noise, LABEL_NOISE_KINDS)
    _check(0.0 <= config.label_noise_rate < 1.0, "label-noise-rate", config.label_noise_rate, "must lie in [0, 1)")
    _check(math.isfinite(config.ditto_lambda) and config.ditto_lambda >= 0.0, "ditto-lambda", config.ditto_lambda,
           "must be a finite number >= 0")

    # Ψ-Net keys (models/psinet.py; the depth's upper bound depends on the net and is checked when it is built)
    _check(0 <= config.psi_groups <= num_classes, "psi-groups", config.psi_groups,
           f"must lie in [0, {num_classes}] (the classes of '{config.dataset}'); 0 means one group per class")
    _check(config.psi_depth >= 0, "psi-depth", config.psi_depth, "must be an integer >= 0")
    from models.registry import model_options  # width-factor is a model option (models/cnn.py)

    _check(math.isfinite(config.width_factor) and config.width_factor > 0.0, "width-factor", config.width_factor,
           "must be a finite number > 0 (1 is the published width)")
    _check(config.width_factor == 1.0 or "width_factor" in model_options(config.model), "width-factor",
           config.width_factor, f"model {config.model!r} has no width option; models that take one: "
           f"{[name for name in list_models() if 'width_factor' in model_options(name)]}")
    from models.init import INITS

    _check_choice("init", config.init, list(INITS))
    _check(0.0 < config.data_fraction <= 1.0, "data-fraction", config.data_fraction,
           "must lie in (0, 1] (the share of each client's partition it keeps; 1 keeps all)")


def results_root(config: RunConfig) -> Path:
    """Where run folders go: ``results-dir`` or ``~/alignfl-results``."""
    return Path(config.results_dir) if config.results_dir else Path.home() / "alignfl-results"
