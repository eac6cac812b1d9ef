"""One module per federated algorithm; importing this package registers them all (one line each)."""

from strategies import ditto, fedavg, fedavgm, fedma, fedper, fedprox, matched, moon, psinet, scaffold, superfed  # noqa: F401
from strategies.registry import STRATEGIES, Algorithm, get_strategy, list_strategies

__all__ = ["STRATEGIES", "Algorithm", "get_strategy", "list_strategies"]
