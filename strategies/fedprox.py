"""FedProx (Li et al., 2020): FedAvg plus a proximal term μ/2·‖w − w_global‖² in every client's loss."""

from __future__ import annotations

import torch
from flwr.serverapp.strategy import FedProx as FlowerFedProx
from torch import nn

from fl_app.config import RunConfig
from strategies.base import LocalUpdate, MetricAggregation, StrategyBase, flower_strategy_kwargs
from strategies.registry import StrategyEntry, register_strategy


class FedProx(StrategyBase, FlowerFedProx):
    """Flower's FedProx (it sends ``proximal-mu`` to clients) with malformed replies dropped."""


class FedProxUpdate(LocalUpdate):
    """Local SGD pulled towards the round's global model by ``proximal-mu``."""

    def begin(self, model: nn.Module) -> None:
        self.global_params = [p.detach().clone() for p in model.parameters()]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        proximal = sum((p - g).pow(2).sum() for p, g in zip(model.parameters(), self.global_params))
        return super().loss(model, x, y) + 0.5 * self.config.proximal_mu * proximal


def build_server(config: RunConfig, metrics: MetricAggregation) -> FedProx:
    return FedProx(proximal_mu=config.proximal_mu, **flower_strategy_kwargs(config, metrics))


register_strategy(StrategyEntry("fedprox", build_server, FedProxUpdate,
                                "FedAvg with a proximal term (proximal-mu) in the client loss"))
