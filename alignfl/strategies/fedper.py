"""FedPer (Arivazhagan, Aggarwal, Singh and Choudhary, "Federated Learning with Personalization Layers",
arXiv:1912.00818, 2019): the body is federated, the classifier head is personal.

Every client keeps its own ``classifier.*`` parameters in ``context.state``; in a
round it loads them over the received head, trains the whole network, keeps the
trained head and sends back the body with the head it *received*, so the personal
head never leaves the client and the server's average changes only the body (the
global head stays the initial one). A client's head starts from the global head the
first time it trains, as a new client's would.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from flwr.app import ArrayRecord
from torch import nn

from alignfl.core.data import ClientData
from alignfl.core.rounds.strategy import ServerStrategy
from alignfl.models.protocol import head_of
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.personal import personal_scores
from alignfl.strategies.registry import STRATEGIES, Algorithm

PERSONAL_HEAD = "fedper-head"
"""``context.state`` ArrayRecord: this client's head."""


def head_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the head's parameters (:func:`alignfl.models.protocol.head_of`)."""
    keys = set(head_of(model).keys)
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if n in keys}


@torch.no_grad()
def load_head(model: nn.Module, head: dict[str, torch.Tensor]) -> None:
    for name, tensor in head.items():
        model.get_parameter(name).copy_(tensor)


class FedPerUpdate(LocalUpdate):
    """Local SGD on the received body under this client's personal head.

    It vectorises: the personal head is loaded before the first step (:meth:`begin`) and put away after the
    last (:meth:`end`)."""

    not_vectorised = None

    def begin(self, model: nn.Module) -> None:
        self.received_head = head_state(model)
        stored = self.context.state.get(PERSONAL_HEAD)
        if stored is not None:
            load_head(model, stored.to_torch_state_dict())

    def end(self, model: nn.Module, total_loss: float) -> dict[str, float]:
        metrics = super().end(model, total_loss)
        self.context.state[PERSONAL_HEAD] = ArrayRecord(head_state(model))
        load_head(model, self.received_head)  # the reply carries the body and the unchanged global head
        return metrics

    def evaluate(self, model: nn.Module, data: ClientData, device: torch.device) -> dict[str, Any]:
        """The global model, and the received body under this client's head."""
        stored = self.context.state.get(PERSONAL_HEAD)
        personal = None
        if stored is not None:
            personal = copy.deepcopy(model)
            load_head(personal, stored.to_torch_state_dict())
        return personal_scores(model, personal, data, device)


class FedPerServer(ServerStrategy):
    """FedAvg of the bodies; the replies carry the received head, not the clients' own."""

    ensemble_problem = "its clients' personal heads never reach the server (a reply carries the head it received)"


STRATEGIES.register(
    Algorithm(
        "fedper",
        FedPerServer,
        FedPerUpdate,
        "FedPer: federated body, personal classifier head kept by each client (server: FedAvg)",
        paper="Arivazhagan et al., Federated Learning with Personalization Layers, arXiv:1912.00818, 2019",
    )
)
