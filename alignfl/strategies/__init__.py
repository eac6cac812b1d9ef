"""One module per federated algorithm; importing this package imports every module in it, and each registers its
algorithm with one line, so a module dropped here is a strategy with no other line to edit."""

from alignfl.plugins.registry import import_modules
from alignfl.strategies.registry import STRATEGIES, Algorithm, get_strategy, list_strategies

__all__ = ["STRATEGIES", "Algorithm", "get_strategy", "list_strategies"]

import_modules(__name__, __path__)  # last: the modules import the names above
