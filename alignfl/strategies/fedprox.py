"""FedProx: FedAvg plus a proximal term μ/2·‖w − w_global‖² in every client's loss.

Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in Heterogeneous
Networks", MLSys 2020.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from alignfl.core.rounds.strategy import ServerStrategy
from alignfl.plugins.options import non_negative, option
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm


@dataclass(frozen=True)
class FedProxSettings:
    fedprox_mu: float = option(
        0.01, "weight of the proximal term (mu / 2) * ||w - w_global||^2", non_negative, "must be a finite number >= 0"
    )


class FedProxUpdate(LocalUpdate):
    """Local SGD pulled towards the round's global model by ``fedprox-mu``.

    It vectorises: the proximal term depends on the parameters alone (:meth:`proximal_mu`)."""

    not_vectorised = None

    def begin(self, model: nn.Module) -> None:
        self.global_params = [p.detach().clone() for p in model.parameters()]

    def proximal_mu(self) -> float:
        return self.settings.fedprox_mu

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        proximal = sum((p - g).pow(2).sum() for p, g in zip(model.parameters(), self.global_params, strict=True))
        return super().loss(model, x, y) + 0.5 * self.proximal_mu() * proximal


STRATEGIES.register(
    Algorithm(
        "fedprox",
        ServerStrategy,
        FedProxUpdate,
        "FedAvg with a proximal term (fedprox-mu) in the client loss",
        FedProxSettings,
        paper="Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020",
        renamed={"proximal-mu": "fedprox-mu"},
    )
)
