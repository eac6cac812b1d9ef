"""FedAvg (McMahan et al., 2017): clients run local SGD, the server averages weighted by examples."""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fl_app.config import RunConfig
from strategies.base import LocalUpdate, MetricAggregation, StrategyBase, flower_strategy_kwargs
from strategies.registry import StrategyEntry, register_strategy


class FedAvg(StrategyBase, FlowerFedAvg):
    """Flower's FedAvg with malformed replies dropped before averaging."""


def build_server(config: RunConfig, metrics: MetricAggregation) -> FedAvg:
    return FedAvg(**flower_strategy_kwargs(config, metrics))


register_strategy(StrategyEntry("fedavg", build_server, LocalUpdate,
                                "weighted averaging of local SGD models"))
