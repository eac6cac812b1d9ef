"""One module per federated algorithm; importing this package registers them all (one line each)."""

from strategies import (  # noqa: F401
    ditto,
    fedavg,
    fedavgm,
    fedma,
    fedper,
    fedprox,
    heterofl,
    matched,
    moon,
    otfusion,
    psinet,
    scaffold,
    superfed,
)
from strategies.registry import STRATEGIES, Algorithm, get_strategy, list_strategies

__all__ = ["STRATEGIES", "Algorithm", "get_strategy", "list_strategies"]
