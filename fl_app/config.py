"""The one run-configuration schema, composed from the parts that own the settings.

A run's keys are the common ones (:mod:`core.config`), the chosen algorithm's (its
settings class, registered with it), the chosen model's options (registered with
it) and the chosen partitioner's settings (registered with it). `flwr run`'s run config, the Hydra configs and the in-process factories all
become a :class:`RunConfig` through :func:`parse_run_config`, so every entry point
validates the same keys the same way. ``flwr run`` passes every key of
``pyproject.toml`` along, so a key of an algorithm, model or partitioner that is not
chosen is accepted at its default and refused, naming its owner, when set to anything else.

:func:`check_run` then builds the model and the algorithm's server side once (no data,
no training): a model the algorithm cannot work with is refused before anything starts.
``pyproject.toml``'s ``[tool.flwr.app.config]`` and ``docs/configuration.md``'s key tables and lists of
registered names are generated from the same classes and registries
(``python -m fl_app.config --write``; tests keep them current), and :func:`validate_run`,
which every entry point calls, refuses a stale table (:func:`pyproject_problem`).
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import RunConfig, common_settings, results_root
from core.data import dataset_info, list_datasets
from core.model_io import build_model_for, to_arrays
from core.partitioning.partitioners import PARTITIONERS, list_partitioners
from core.strategy import RunContext, ServerStrategy
from fl_app.tracking import check_tracking
from models import list_models
from models.protocol import head_of
from models.registry import model_options
from plugins.options import ConfigError, Setting, build_settings, coerce, refuse, settings_fields
from strategies import get_strategy, list_strategies

__all__ = [
    "ConfigError",
    "RunConfig",
    "check_run",
    "default_run_config",
    "parse_run_config",
    "results_root",
    "validate_run",
]

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@dataclass(frozen=True)
class OwnedSetting:
    """A key of some algorithms, models or partitioners: its declaration and who declares it."""

    setting: Setting
    owners: tuple[str, ...]
    kind: str  # "strategy", "model" or "partitioner": the run-config key that chooses the owner


def _owned_classes() -> list[tuple[str, str, type]]:
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
    sources = _owned_classes()
    for kind, name, settings in sources:
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


def _choice(values: Mapping[str, Any], key: str, allowed: list[str]) -> str:
    default = next(s.default for s in common_settings() if s.key == key)
    value = coerce(key, values.get(key, default), str)
    if value not in allowed:
        raise ConfigError(f"run-config key '{key}' = {value!r} is not allowed: choose one of {allowed}")
    return value


def parse_run_config(values: Mapping[str, Any] | None = None) -> RunConfig:
    """Build and check a :class:`RunConfig` from run-config keys.

    Missing keys take their defaults. Unknown keys, wrong types, out-of-range values and keys of an algorithm,
    model or partitioner that is not chosen, set away from their default, raise :class:`ConfigError`.
    """
    values = dict(values or {})
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
    return base.replace(
        settings=build_settings(parts["settings"], values), model_options=build_settings(parts["model_options"], values)
    )


def _refuse_if_changed(key: str, value: Any, owned: OwnedSetting, chosen: str) -> None:
    if coerce(key, value, owned.setting.kind) == owned.setting.default:
        return  # `flwr run` passes every key of pyproject.toml, at its default
    owners = ", ".join(f"'{name}'" for name in owned.owners)
    raise ConfigError(
        f"run-config key '{key}' = {value!r} belongs to {owned.kind} {owners}, not to the chosen "
        f"{owned.kind} '{chosen}': set {owned.kind}={owned.owners[0]} or leave '{key}' out"
    )


def build_context(config: RunConfig, model: Any) -> RunContext:
    """What the server side of the algorithm receives: the run's settings and what the model says of itself."""
    spec = model.permutation_spec() if hasattr(model, "permutation_spec") else None
    layout = model.layout() if hasattr(model, "layout") else None
    return RunContext(config, to_arrays(model), spec, head_of(model), layout)


def check_run(config: RunConfig) -> ServerStrategy:
    """Build the model (no data is read) and the algorithm's server side once, so that a model that does not
    fit the algorithm, or a model option the net refuses, is refused before anything starts."""
    input_shape, num_classes = dataset_info(config.dataset)
    try:
        model = build_model_for(config, input_shape, num_classes)
        context = build_context(config, model)
    except ValueError as error:
        raise ConfigError(f"model {config.model!r} with {config.dataset!r}: {error}") from None
    return get_strategy(config.strategy).server(context)


def path_problem(path: Path, writable: bool) -> str | None:
    """Why ``path`` cannot be used, or None: its nearest existing ancestor must be a directory this process can
    read (and, when ``writable``, create files in; tried with a temporary file that is removed at once)."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.R_OK | os.X_OK):
        return f"{existing} is not readable by this user"
    if writable:
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as error:
            return f"cannot create files in {existing} ({error.strerror or error})"
    return None


def check_paths(config: RunConfig) -> None:
    """Refuse a results folder nobody can write, or a data root that does not exist, naming the key."""
    problem = path_problem(results_root(config), writable=True)
    if problem is not None:
        raise refuse("results-dir", config.results_dir, f"the run folder must be writable: {problem}")
    if config.data_root and not Path(config.data_root).is_dir():
        raise refuse("data-root", config.data_root, "must be an existing directory (a torchvision-style root)")
    if config.data_root and not os.access(config.data_root, os.R_OK | os.X_OK):
        raise refuse("data-root", config.data_root, "must be readable by this user")


def validate_run(config: RunConfig) -> ServerStrategy:
    """Everything that can be checked before a run starts: ``pyproject.toml``'s run-config table
    (:func:`pyproject_problem`), folders, tracking, model and algorithm (:func:`check_run`)."""
    problem = pyproject_problem()
    if problem is not None:
        raise ConfigError(problem)
    check_paths(config)
    check_tracking(config)
    return check_run(config)


def pyproject_table() -> str:
    """``[tool.flwr.app.config]``, generated from the settings classes."""
    lines = ["[tool.flwr.app.config]"]
    lines += [f"{key} = {_toml(value)}" for key, value in default_run_config().items()]
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


_TABLE = re.compile(r"^\[tool\.flwr\.app\.config\]\n(?:[^\[\n].*\n|\n)*", re.MULTILINE)


def write_pyproject(path: Path = PYPROJECT) -> bool:
    """Rewrite the generated table in ``pyproject.toml``; returns whether it changed."""
    text = path.read_text()
    updated = _TABLE.sub(pyproject_table() + "\n", text, count=1)
    if updated != text:
        path.write_text(updated)
    return updated != text


REGENERATE = "python -m fl_app.config --write"
"""The command that regenerates ``pyproject.toml``'s run-config table and the docs' generated sections."""


def pyproject_problem() -> str | None:
    """Why ``pyproject.toml``'s ``[tool.flwr.app.config]`` (:data:`PYPROJECT`) is not the table the registered
    settings classes make, or None; the message names the keys and the command that regenerates the table.

    ``flwr run`` refuses a run-config key the table lacks, with only ``[code: 15] Invalid run configuration``
    and only after a SuperLink has started: a new algorithm's or model's key must be in it before a run.
    A key at another default than its settings class declares, or one nobody declares, is refused as well:
    ``flwr run`` hands every key of the table to the apps, which refuse a key nobody declares and a key of an
    algorithm or model that is not chosen at anything but its default, again only once the run has started;
    and a plain ``flwr run .`` would run the stale default."""
    if not PYPROJECT.is_file():
        return f"no {PYPROJECT}: `flwr run` needs it (its [tool.flwr.app.config] is made by `{REGENERATE}`)"
    table = tomllib.loads(PYPROJECT.read_text()).get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    declared, owned = default_run_config(), owned_settings()
    problems = []
    missing = [key for key in declared if key not in table]
    if missing:
        named = ", ".join(
            f"'{key}'" + (f" (of {owned[key].kind} {', '.join(map(repr, owned[key].owners))})" if key in owned else "")
            for key in missing
        )
        problems.append(f"it lacks {named}, which `flwr run` refuses with only '[code: 15] Invalid run configuration'")
    stale = {key: (table[key], value) for key, value in declared.items() if key in table and table[key] != value}
    if stale:
        problems.append(
            "its defaults differ from the settings classes' for "
            + ", ".join(f"'{key}' ({old!r}, declared {new!r})" for key, (old, new) in stale.items())
        )
    unknown = [key for key in table if key not in declared]
    if unknown:
        problems.append(f"it holds key(s) {unknown} that no setting declares")
    if not problems:
        return None
    return (
        f"{PYPROJECT}'s [tool.flwr.app.config] is not the table the registered strategies, models and "
        f"partitioners make: {'; '.join(problems)}. Regenerate it with `{REGENERATE}`."
    )


def keys_markdown() -> str:
    """The run-config key tables of ``docs/configuration.md``, generated from the settings classes' defaults and help."""

    def rows(settings: list[Setting]) -> list[str]:
        return [f"| `{s.key}` | `{_toml(s.default)}` | {s.help} |" for s in settings]

    header = ["| key | default | meaning |", "|---|---|---|"]
    lines = ["Common to every run:", "", *header, *rows(common_settings()), ""]
    for kind, name, settings in _owned_classes():
        own = settings_fields(settings)
        if own:
            lines += [f"`{kind}={name}`:", "", *header, *rows(own), ""]
    return "\n".join(lines)


def names_markdown() -> str:
    """The lists (``docs/configuration.md``) of what ``strategy``, ``model``, ``dataset`` and ``partitioner`` may be, from the
    registries, so that a newly registered one is listed by ``python -m fl_app.config --write``."""

    def listed(names: list[str]) -> str:
        return ", ".join(f"`{name}`" for name in names)

    lines = ["| strategy | what it does |", "|---|---|"]
    lines += [f"| `{name}` | {get_strategy(name).summary} |" for name in list_strategies()]
    lines += [
        "",
        f"Models: {listed(list_models())}.",
        "",
        f"Datasets: {listed(list_datasets())}.",
        "",
        f"Partitioners: {listed(list_partitioners())}.",
    ]
    return "\n".join(lines) + "\n"


CONFIGURATION_PAGE = PYPROJECT.parent / "docs" / "configuration.md"
KEYS_BEGIN, KEYS_END = "<!-- run-config keys: generated by python -m fl_app.config --write -->", "<!-- end of keys -->"
NAMES_BEGIN, NAMES_END = (
    "<!-- registered names: generated by python -m fl_app.config --write -->",
    "<!-- end of names -->",
)


def write_docs(path: Path = CONFIGURATION_PAGE) -> bool:
    """Rewrite the configuration page's generated sections (the key tables, the registered names) between their markers;
    returns whether they changed."""
    text = path.read_text()
    updated = text
    for begin, end, markdown in ((KEYS_BEGIN, KEYS_END, keys_markdown), (NAMES_BEGIN, NAMES_END, names_markdown)):
        head, found, rest = updated.partition(begin)
        _, closed, tail = rest.partition(end)
        if not (found and closed):
            raise ValueError(f"{path} lacks the markers {begin} ... {end} of a generated section")
        updated = f"{head}{begin}\n{markdown()}{end}{tail}"
    if updated != text:
        path.write_text(updated)
    return updated != text


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Print or write the generated run-config tables (pyproject.toml's "
        "[tool.flwr.app.config], docs/configuration.md's key tables and registered names)."
    )
    parser.add_argument(
        "--write", action="store_true", help="rewrite pyproject.toml and docs/configuration.md in place"
    )
    args = parser.parse_args()
    if args.write:
        print("pyproject.toml " + ("updated" if write_pyproject() else "already current"))
        print("docs/configuration.md " + ("updated" if write_docs() else "already current"))
    else:
        print(pyproject_table(), end="")


if __name__ == "__main__":
    main()
