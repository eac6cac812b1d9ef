"""Ditto (Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through Personalization",
ICML 2021): FedAvg for the global model, plus a personal model pulled towards it.

A selected client runs FedAvg's local update on the received global model w and
sends it back; it also trains its personal model v (kept in ``context.state``,
started from the first global model it receives) for the same number of local
epochs on CE(v) + (ditto-lambda / 2)·‖v − w‖², with w the *received* global model
(Li et al., Algorithm 1). v never leaves the client.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from alignfl.core.config import RunConfig
from alignfl.core.data import ClientData
from alignfl.core.model_io import federated_state
from alignfl.core.rounds.strategy import ServerStrategy
from alignfl.plugins.options import non_negative, option
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.personal import personal_scores
from alignfl.strategies.registry import STRATEGIES, Algorithm

PERSONAL_MODEL = "ditto-personal"
"""``context.state`` ArrayRecord: the personal model's floating-point state."""


@dataclass(frozen=True)
class DittoSettings:
    ditto_lambda: float = option(
        0.1, "pull of each personal model towards the global one", non_negative, "must be a finite number >= 0"
    )


class _PersonalStep(LocalUpdate):
    """Local SGD on CE plus (λ/2)·‖v − anchor‖² (the received global model)."""

    def __init__(self, config: RunConfig, anchor: list[torch.Tensor], received: RecordDict | None = None) -> None:
        super().__init__(config, context=None, received=received)  # the round's message: its lr decay
        self.anchor = anchor

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pull = sum((p - a).pow(2).sum() for p, a in zip(model.parameters(), self.anchor))
        return super().loss(model, x, y) + 0.5 * self.settings.ditto_lambda * pull


def stored_personal(context: Any, model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` holding this client's personal model, or None before its first training."""
    stored = context.state.get(PERSONAL_MODEL)
    if stored is None:
        return None
    personal = copy.deepcopy(model)
    personal.load_state_dict(stored.to_torch_state_dict(), strict=False)
    return personal


class DittoUpdate(LocalUpdate):
    """FedAvg's local update of the global model, then the personal model's proximal update."""

    not_vectorised = "it trains two models one after the other (the global one, then the personal one)"

    def train(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator, device: torch.device
    ) -> dict[str, float]:
        personal = stored_personal(self.context, model)
        if personal is None:
            personal = copy.deepcopy(model)
        anchor = [p.detach().clone() for p in model.parameters()]
        metrics = super().train(model, x, y, generator, device)
        personal_metrics = _PersonalStep(self.config, anchor, self.received).train(personal, x, y, generator, device)
        self.context.state[PERSONAL_MODEL] = ArrayRecord(
            {k: v.detach().cpu() for k, v in federated_state(personal).items()}
        )
        return {**metrics, "personal-train-loss": personal_metrics["train-loss"]}

    def evaluate(self, model: nn.Module, data: ClientData, device: torch.device) -> dict[str, Any]:
        return personal_scores(model, stored_personal(self.context, model), data, device)


STRATEGIES.register(
    Algorithm(
        "ditto",
        ServerStrategy,
        DittoUpdate,
        "Ditto: FedAvg plus a personal model pulled towards the global one (ditto-lambda)",
        DittoSettings,
        paper="Li et al., Ditto: Fair and Robust Federated Learning Through Personalization, ICML 2021",
    )
)
