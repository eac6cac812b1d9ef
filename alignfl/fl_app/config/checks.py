"""Pre-flight checks: everything that can be refused before a run starts.

:func:`check_run` builds the model and the algorithm's server side once (no data, no
training), so a model the algorithm cannot work with is refused before anything starts;
:func:`validate_run`, which every entry point calls, adds the folders, the tracking and
``pyproject.toml``'s generated table (:func:`pyproject_problem`).
"""

from __future__ import annotations

import os
import tempfile
import tomllib
from logging import WARNING
from pathlib import Path

from flwr.common.logger import log

from alignfl.core.config import RunConfig, results_root
from alignfl.core.data import dataset_info
from alignfl.core.model_io import build_model_for
from alignfl.core.rounds.strategy import ServerStrategy, build_context
from alignfl.core.widths import check_widths_used
from alignfl.fl_app.config import tables
from alignfl.fl_app.config.schema import default_run_config, owned_settings
from alignfl.fl_app.locations import own_folder_problem
from alignfl.fl_app.tracking import check_tracking
from alignfl.plugins.options import ConfigError, refuse
from alignfl.strategies import get_strategy


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
    read (and, when ``writable``, create files in; tried with a temporary file that is removed at once), and a
    folder to write to must lie outside site-packages and alignfl's own code
    (:func:`alignfl.fl_app.locations.own_folder_problem`)."""
    if writable and (problem := own_folder_problem(path)) is not None:
        return problem
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
    """Refuse a results folder this user cannot write or that lies among the installed code (site-packages,
    alignfl's package folder), or a data root that does not exist, naming the key."""
    problem = path_problem(results_root(config), writable=True)
    if problem is not None:
        raise refuse(
            "results-dir",
            config.results_dir,
            "must name a folder of your own that this user can write to (e.g. one under the current folder): "
            + problem,
        )
    if config.data_root and not Path(config.data_root).is_dir():
        raise refuse("data-root", config.data_root, "must be an existing directory (a torchvision-style root)")
    if config.data_root and not os.access(config.data_root, os.R_OK | os.X_OK):
        raise refuse("data-root", config.data_root, "must be readable by this user")


def validate_run(config: RunConfig, num_partitions: int | None = None) -> ServerStrategy:
    """Everything that can be checked before a run starts: ``pyproject.toml``'s run-config table
    (:func:`pyproject_problem`), folders, tracking, model and algorithm (:func:`check_run`), and, where the
    caller knows the number of partitions (the launcher, deploy, a sweep job), the widths the clients get."""
    problem = pyproject_problem()
    if problem is not None:
        raise ConfigError(problem)
    check_paths(config)
    check_tracking(config)
    if num_partitions is not None:
        check_clients(config, num_partitions)
    return check_run(config)


def check_clients(config: RunConfig, num_partitions: int) -> None:
    """What depends on the number of partitions: ``client-widths`` no client gets are refused where they set the
    global width, else logged as a warning."""
    warning = check_widths_used(config, num_partitions)
    if warning is not None:
        log(WARNING, "[alignfl] %s", warning)


def pyproject_problem() -> str | None:
    """Why ``pyproject.toml``'s ``[tool.flwr.app.config]`` (:data:`alignfl.fl_app.config.tables.PYPROJECT`) is not the
    table the registered settings classes make, or None; the message names the keys and the command that
    regenerates the table.

    ``flwr run`` refuses a run-config key the table lacks, with only ``[code: 15] Invalid run configuration``
    and only after a SuperLink has started: a new algorithm's or model's key must be in it before a run.
    A key at another default than its settings class declares, or one nobody declares, is refused as well:
    ``flwr run`` hands every key of the table to the apps, which refuse a key nobody declares and a key of an
    algorithm or model that is not chosen at anything but its default, again only once the run has started;
    and a plain ``flwr run .`` would run the stale default."""
    path, command = tables.PYPROJECT, tables.REGENERATE
    if not path.is_file():
        return f"no {path}: `flwr run` needs it (its [tool.flwr.app.config] is made by `{command}`)"
    table = tomllib.loads(path.read_text()).get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
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
        f"{path}'s [tool.flwr.app.config] is not the table the registered strategies, models and "
        f"partitioners make: {'; '.join(problems)}. Regenerate it with `{command}`."
    )
