"""One module per federated algorithm; importing this package registers them all (one line each)."""

from strategies import ditto, fedavg, fedavgm, fedma, fedper, fedprox, matched, moon, psinet, scaffold, superfed  # noqa: F401
from strategies.registry import Algorithm, get_strategy, list_strategies, register_strategy

__all__ = ["Algorithm", "get_strategy", "list_strategies", "register_strategy"]
