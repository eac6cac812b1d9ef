"""FedAvg (McMahan, Moore, Ramage, Hampson and Agüera y Arcas, "Communication-Efficient Learning of Deep
Networks from Decentralized Data", AISTATS 2017): clients run local SGD, the server averages weighted by examples."""

from alignfl.core.rounds.strategy import ServerStrategy
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm

STRATEGIES.register(
    Algorithm(
        "fedavg",
        ServerStrategy,
        LocalUpdate,
        "weighted averaging of local SGD models",
        paper="McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017",
    )
)
