"""FedAvgM (Hsu et al., 2019): the server applies the averaged update with momentum."""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvgM as FlowerFedAvgM

from fl_app.config import RunConfig
from strategies.base import LocalUpdate, MetricAggregation, StrategyBase, flower_strategy_kwargs
from strategies.registry import StrategyEntry, register_strategy


class FedAvgM(StrategyBase, FlowerFedAvgM):
    """Flower's FedAvgM (server-lr, server-momentum) with malformed replies dropped."""


def build_server(config: RunConfig, metrics: MetricAggregation) -> FedAvgM:
    return FedAvgM(server_learning_rate=config.server_lr, server_momentum=config.server_momentum,
                   **flower_strategy_kwargs(config, metrics))


register_strategy(StrategyEntry("fedavgm", build_server, LocalUpdate,
                                "FedAvg with server momentum (server-lr, server-momentum)"))
