"""One module per federated algorithm; importing this package registers them all."""

from strategies import fedavg, fedavgm, fedprox  # noqa: F401  (registration)
from strategies import moon  # noqa: F401  (registration)
from strategies import scaffold  # noqa: F401  (registration)
from strategies import matched  # noqa: F401  (registration)
from strategies import fedma  # noqa: F401  (registration)
from strategies import superfed  # noqa: F401  (registration)
from strategies import fedper  # noqa: F401  (registration)
from strategies import ditto  # noqa: F401  (registration)
from strategies import psinet  # noqa: F401  (registration)
from strategies.registry import StrategyEntry, get_strategy, list_strategies, register_strategy

__all__ = ["StrategyEntry", "get_strategy", "list_strategies", "register_strategy"]
