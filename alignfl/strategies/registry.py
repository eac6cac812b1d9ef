"""Name → algorithm: its settings class, its server side, the client update it expects, the paper it follows.

An algorithm is one module in ``alignfl/strategies/`` that ends with one line,
``STRATEGIES.register(Algorithm(...))``; importing the package imports every module in it, so
dropping the file in registers it. The run config, the Hydra configs, ``pyproject.toml``'s
defaults and the README's method table are derived from what is registered here
(``python -m alignfl.fl_app.config --write``).

Key names: an algorithm's own run-config keys start with its name (``moon-mu``); keys it
borrows from a settings family keep the family's prefix (``bbp-sigma``; the rule is
:mod:`alignfl.plugins.options`'s). Registration refuses a key that breaks the rule, naming the key and
the expected prefix. A key renamed since a release stays readable under its old name
(``renamed``): a run config or checkpoint that uses it is read with a one-line warning naming
the new key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from alignfl.core.rounds.strategy import RunContext, ServerStrategy
from alignfl.plugins.options import NoOptions, prefix_problems, settings_fields
from alignfl.plugins.registry import Registry
from alignfl.strategies.base import LocalUpdate


@dataclass(frozen=True)
class Algorithm:
    """One algorithm.

    Parameters
    ----------
    name : str
        The value of the run-config key ``strategy``.
    server : callable
        Builds its server side from the run context; raises ``ConfigError`` for a model it cannot work with.
    client : type
        Its local update (:class:`alignfl.strategies.base.LocalUpdate` or a subclass).
    summary : str
        One line for the README's method table: what it does, naming its keys.
    settings : type, optional
        Its settings class (:mod:`alignfl.plugins.options`); every key starts with ``<name>-`` or is a settings
        family's.
    paper : str, optional
        The paper it follows: authors, title, venue and year (or arXiv id), for the README's method table.
    renamed : mapping of str to str, optional
        Old key → its key now, for keys renamed since a release, so old run configs and checkpoints still load.

    Raises
    ------
    ValueError
        For a key that breaks the naming rule, or a ``renamed`` entry whose new key is not one of its keys.

    Examples
    --------
    The last line of a module ``alignfl/strategies/halfway.py`` (its settings class, server side and client update
    above it):

    >>> STRATEGIES.register(Algorithm("halfway", Halfway, LocalUpdate, "FedAvg, half a step", HalfwaySettings))
    """

    name: str
    server: Callable[[RunContext], ServerStrategy]
    client: type[LocalUpdate]
    summary: str
    settings: type = NoOptions
    paper: str = ""
    renamed: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"strategy '{self.name}'"
        problems = prefix_problems(self.name, self.settings)
        if problems:
            raise ValueError(f"{where}: {'; '.join(problems)}")
        keys = {setting.key for setting in settings_fields(self.settings)}
        for old, new in self.renamed.items():
            if new not in keys or old in keys:
                raise ValueError(
                    f"{where}: renamed key '{old}' -> '{new}': the new name must be one of its keys "
                    f"{sorted(keys)} and the old one must not"
                )


STRATEGIES: Registry[Algorithm] = Registry("strategy")
"""Every algorithm, registered by its own module."""


def get_strategy(name: str) -> Algorithm:
    """The registered algorithm called ``name``."""
    return STRATEGIES.get(name)


def list_strategies() -> list[str]:
    """Names of every registered algorithm, sorted."""
    return STRATEGIES.names()
