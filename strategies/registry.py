"""Name → algorithm: its settings class, its server side and the client update it expects.

An algorithm is one module that ends with one line, ``STRATEGIES.register(Algorithm(...))``;
the run config, the Hydra configs and ``pyproject.toml``'s defaults are derived from the
settings classes registered here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.strategy import RunContext, ServerStrategy
from plugins.options import NoOptions
from plugins.registry import Registry
from strategies.base import LocalUpdate


@dataclass(frozen=True)
class Algorithm:
    """One algorithm.

    ``settings`` is its settings class (:mod:`plugins.options`; keys of no other algorithm may share a name
    with a different default); ``server`` builds its server side from the run context and raises
    ``ConfigError`` for a model it cannot work with; ``client`` is its local update."""

    name: str
    server: Callable[[RunContext], ServerStrategy]
    client: type[LocalUpdate]
    summary: str
    settings: type = NoOptions


STRATEGIES: Registry[Algorithm] = Registry("strategy")
"""Every algorithm, registered by its own module."""


def get_strategy(name: str) -> Algorithm:
    """The registered algorithm called ``name``."""
    return STRATEGIES.get(name)


def list_strategies() -> list[str]:
    """Names of every registered algorithm, sorted."""
    return STRATEGIES.names()
