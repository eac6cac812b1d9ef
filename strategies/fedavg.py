"""FedAvg (McMahan et al., 2017): clients run local SGD, the server averages weighted by examples."""

from core.strategy import ServerStrategy
from strategies.base import LocalUpdate
from strategies.registry import STRATEGIES, Algorithm

STRATEGIES.register(Algorithm("fedavg", ServerStrategy, LocalUpdate, "weighted averaging of local SGD models"))
