"""Name → algorithm: the server Strategy factory and the client local update it expects.

Adding an algorithm is one module that calls :func:`register_strategy` and one
import line in ``strategies/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flwr.serverapp.strategy import Strategy

    from fl_app.config import RunConfig
    from strategies.base import LocalUpdate, MetricAggregation


@dataclass(frozen=True)
class StrategyEntry:
    """One algorithm: how to build its server strategy and which client update it runs."""

    name: str
    build_server: Callable[[RunConfig, MetricAggregation], Strategy]
    client_update: type[LocalUpdate]
    summary: str


_REGISTRY: dict[str, StrategyEntry] = {}


def register_strategy(entry: StrategyEntry) -> StrategyEntry:
    """Add an algorithm under ``entry.name``; a name may be registered once."""
    if entry.name in _REGISTRY:
        raise ValueError(f"strategy '{entry.name}' is already registered")
    _REGISTRY[entry.name] = entry
    return entry


def get_strategy(name: str) -> StrategyEntry:
    """The registered algorithm called ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy '{name}'; allowed: {list_strategies()}") from None


def list_strategies() -> list[str]:
    """Names of every registered algorithm, sorted."""
    return sorted(_REGISTRY)
