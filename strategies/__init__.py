"""One module per federated algorithm; importing this package registers them all."""

from strategies import fedavg, fedavgm, fedprox  # noqa: F401  (registration)
from strategies.registry import StrategyEntry, get_strategy, list_strategies, register_strategy

__all__ = ["StrategyEntry", "get_strategy", "list_strategies", "register_strategy"]
