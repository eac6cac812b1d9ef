"""The run-configuration schema: run-config keys → a checked :class:`~alignfl.core.config.RunConfig`.

A run's keys are the common ones (:mod:`alignfl.core.config`), the chosen algorithm's (its settings
class, registered with it), the chosen model's options (registered with it) and the chosen
partitioner's settings (registered with it). ``flwr run``'s run config, the Hydra configs and
the in-process factories all become a :class:`~alignfl.core.config.RunConfig` through
:func:`parse_run_config`, so every entry point validates the same keys the same way.
``flwr run`` passes every key of ``pyproject.toml`` along, so a key of an algorithm, model or
partitioner that is not chosen is accepted at its default and refused, naming its owner, when
set to anything else.

A key renamed since a release (an algorithm's registration lists it in ``renamed``) is read
under its old name with a one-line :class:`FutureWarning` naming the new key
(:func:`rename_old_keys`), rather than refused: run folders' ``config.json`` and checkpoints
written before the rename hold the old names, and ``resume-from`` and the analysis tools read
them; the value means the same under either name.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from alignfl.core.config import RunConfig, common_settings
from alignfl.core.partitioning.partitioners import PARTITIONERS, list_partitioners
from alignfl.models import list_models
from alignfl.models.registry import model_options
from alignfl.plugins.options import ConfigError, Setting, build_settings, coerce, refuse, settings_fields
from alignfl.strategies import get_strategy, list_strategies


@dataclass(frozen=True)
class OwnedSetting:
    """A key of some algorithms, models or partitioners: its declaration and who declares it."""

    setting: Setting
    owners: tuple[str, ...]
    kind: str  # "strategy", "model" or "partitioner": the run-config key that chooses the owner


def owned_classes() -> list[tuple[str, str, type]]:
    """(kind, name, settings class) of every algorithm, model and partitioner."""
    return [
        *(("strategy", name, get_strategy(name).settings) for name in list_strategies()),
        *(("model", name, model_options(name)) for name in list_models()),
        *(("partitioner", name, PARTITIONERS.get(name).settings) for name in list_partitioners()),
    ]


def owned_settings() -> dict[str, OwnedSetting]:
    """Every algorithm's, model's and partitioner's key, with the names that declare it (their defaults must
    agree)."""
    owned: dict[str, OwnedSetting] = {}
    for kind, name, settings in owned_classes():
        for setting in settings_fields(settings):
            known = owned.get(setting.key)
            if known is not None and known.setting.default != setting.default:
                raise ValueError(
                    f"key '{setting.key}' has default {setting.default!r} in {kind} '{name}' but "
                    f"{known.setting.default!r} in {known.kind} {list(known.owners)}"
                )
            owners = (*known.owners, name) if known is not None else (name,)
            owned[setting.key] = OwnedSetting(setting, owners, kind)
    return owned


def default_run_config() -> dict[str, Any]:
    """Every key any run may set, at its default: what ``pyproject.toml`` declares."""
    values = {setting.key: setting.default for setting in common_settings()}
    values.update({key: owned.setting.default for key, owned in owned_settings().items()})
    return values


def renamed_keys() -> dict[str, dict[str, str]]:
    """Old key → {algorithm: the key's name now}, from every registered algorithm's ``renamed``."""
    renamed: dict[str, dict[str, str]] = {}
    for name in list_strategies():
        for old, new in get_strategy(name).renamed.items():
            renamed.setdefault(old, {})[name] = new
    return renamed


def rename_old_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with every old key name under its name now, each with a one-line :class:`FutureWarning`.

    An old name several algorithms shared (``server-lr``) takes the chosen algorithm's new name, or else the
    first one's (a key of an algorithm that is not chosen is then refused or ignored as any other). A value
    under the old name wins over the new key at its default (``flwr run`` and the launcher pass every key of
    ``pyproject.toml``); both set to different values are refused.
    """
    renamed, result = renamed_keys(), dict(values)
    strategy = values.get("strategy", next(s.default for s in common_settings() if s.key == "strategy"))
    defaults = {s.key: s.default for _, _, settings in owned_classes() for s in settings_fields(settings)}
    for old in sorted(set(values) & (set(renamed) - set(defaults))):  # an old name in use again is the new key
        owners = renamed[old]
        new = owners.get(strategy, next(iter(owners.values())))
        value = result.pop(old)
        if new in values and values[new] not in (value, defaults[new]):
            raise ConfigError(
                f"run-config keys '{old}' = {value!r} and '{new}' = {values[new]!r}: '{old}' is the old name of "
                f"'{new}'; set '{new}' only"
            )
        warnings.warn(f"run-config key '{old}' is now '{new}'; the old name is read for now", FutureWarning, 3)
        result[new] = value
    return result


def _choice(values: Mapping[str, Any], key: str, allowed: list[str]) -> str:
    default = next(s.default for s in common_settings() if s.key == key)
    value = coerce(key, values.get(key, default), str)
    if value not in allowed:
        raise ConfigError(f"run-config key '{key}' = {value!r} is not allowed: choose one of {allowed}")
    return value


def parse_run_config(values: Mapping[str, Any] | None = None) -> RunConfig:
    """Build and check a :class:`~alignfl.core.config.RunConfig` from run-config keys.

    Parameters
    ----------
    values : mapping of str to scalar, optional
        Run-config keys (hyphenated, as ``flwr run --run-config`` takes them) and their values; missing
        keys take their defaults.

    Returns
    -------
    RunConfig
        The common settings, with the chosen algorithm's, model's and partitioner's settings objects.

    Raises
    ------
    ConfigError
        For an unknown key, a wrong type, an out-of-range value, or a key of an algorithm, model or
        partitioner that is not chosen, set away from its default; the message names the key and what is
        allowed.

    Examples
    --------
    >>> parse_run_config({"strategy": "moon", "moon-mu": 5.0}).settings.moon_mu
    5.0
    """
    values = rename_old_keys(values or {})
    choices = {
        kind: _choice(values, kind, allowed)
        for kind, allowed in (
            ("strategy", list_strategies()),
            ("model", list_models()),
            ("partitioner", list_partitioners()),
        )
    }
    parts = {
        "settings": get_strategy(choices["strategy"]).settings,
        "model_options": model_options(choices["model"]),
        "partitioner_settings": PARTITIONERS.get(choices["partitioner"]).settings,
    }
    chosen = {s.key for s in common_settings()} | {s.key for part in parts.values() for s in settings_fields(part)}
    owned = owned_settings()
    unknown = sorted(key for key in values if key not in chosen and key not in owned)
    if unknown:
        raise ConfigError(f"unknown run-config key(s) {unknown}; allowed keys: {sorted(chosen | set(owned))}")
    for key in sorted(set(values) - chosen):
        _refuse_if_changed(key, values[key], owned[key], choices[owned[key].kind])
    common = {key: value for key, value in values.items() if key in chosen}
    partitioning = build_settings(parts["partitioner_settings"], values)
    base = build_settings(RunConfig, common, partitioner_settings=partitioning)
    _refuse_unrepairable(base)
    return base.replace(
        settings=build_settings(parts["settings"], values), model_options=build_settings(parts["model_options"], values)
    )


def repairable_strategies() -> list[str]:
    """The algorithms whose server side merges aligned units, so that ``repair=on`` is allowed with them."""
    return [name for name in list_strategies() if getattr(get_strategy(name).server, "repairable", False)]


def _refuse_unrepairable(config: RunConfig) -> None:
    if config.repair == "on" and config.strategy not in repairable_strategies():
        raise refuse(
            "repair",
            "on",
            f"strategy '{config.strategy}' does not align the clients' units before merging them, so there is no "
            f"aligned merge to repair; use repair=off, or one of {repairable_strategies()}",
        )


def _refuse_if_changed(key: str, value: Any, owned: OwnedSetting, chosen: str) -> None:
    if coerce(key, value, owned.setting.kind) == owned.setting.default:
        return  # `flwr run` passes every key of pyproject.toml, at its default
    owners = ", ".join(f"'{name}'" for name in owned.owners)
    raise ConfigError(
        f"run-config key '{key}' = {value!r} belongs to {owned.kind} {owners}, not to the chosen "
        f"{owned.kind} '{chosen}': set {owned.kind}={owned.owners[0]} or leave '{key}' out"
    )
