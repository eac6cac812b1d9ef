"""Name → algorithm: its settings class, its server side and the client update it expects.

An algorithm is one module that ends with one line, ``register_strategy(Algorithm(...))``;
the run config, the Hydra configs and ``pyproject.toml``'s defaults are derived from the
settings classes registered here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.strategy import RunContext, ServerStrategy
from plugins.options import NoOptions
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


_REGISTRY: dict[str, Algorithm] = {}


def register_strategy(algorithm: Algorithm) -> Algorithm:
    """Add an algorithm under ``algorithm.name``; a name may be registered once."""
    if algorithm.name in _REGISTRY:
        raise ValueError(f"strategy '{algorithm.name}' is already registered")
    _REGISTRY[algorithm.name] = algorithm
    return algorithm


def get_strategy(name: str) -> Algorithm:
    """The registered algorithm called ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy '{name}'; allowed: {list_strategies()}") from None


def list_strategies() -> list[str]:
    """Names of every registered algorithm, sorted."""
    return sorted(_REGISTRY)
