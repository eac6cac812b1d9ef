"""The one run-configuration schema, composed from the parts that own the settings, by job.

* :mod:`alignfl.fl_app.config.schema`: run-config keys → :class:`~alignfl.core.config.RunConfig`
  (:func:`parse_run_config`), the same for every entry point;
* :mod:`alignfl.fl_app.config.checks`: what is refused before a run starts (:func:`check_run`,
  :func:`validate_run`, :func:`pyproject_problem`);
* :mod:`alignfl.fl_app.config.tables`: the generated ``pyproject.toml`` table, the README's method
  table and ``docs/configuration.md``'s key tables and names (``python -m alignfl.fl_app.config --write``).

The run context the algorithm's server side receives is built beside its definition
(:func:`alignfl.core.rounds.strategy.build_context`).
"""

from alignfl.core.config import RunConfig, results_root
from alignfl.core.rounds.strategy import build_context
from alignfl.fl_app.config.checks import check_paths, check_run, path_problem, pyproject_problem, validate_run
from alignfl.fl_app.config.schema import (
    OwnedSetting,
    default_run_config,
    owned_settings,
    parse_run_config,
    rename_old_keys,
    renamed_keys,
)
from alignfl.fl_app.config.tables import (
    REGENERATE,
    keys_markdown,
    methods_markdown,
    names_markdown,
    pyproject_table,
    write_all,
    write_pyproject,
)
from alignfl.plugins.options import ConfigError

__all__ = [
    "REGENERATE",
    "ConfigError",
    "OwnedSetting",
    "RunConfig",
    "build_context",
    "check_paths",
    "check_run",
    "default_run_config",
    "keys_markdown",
    "methods_markdown",
    "names_markdown",
    "owned_settings",
    "parse_run_config",
    "path_problem",
    "pyproject_problem",
    "pyproject_table",
    "rename_old_keys",
    "renamed_keys",
    "results_root",
    "validate_run",
    "write_all",
    "write_pyproject",
]
