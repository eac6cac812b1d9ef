"""FedAvgM: the server applies the averaged update with momentum.

Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated
Visual Classification", arXiv:1909.06335, 2019.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from alignfl.core.rounds.strategy import Merge, Reply, RunContext, ServerStep, ServerStrategy, weighted_mean
from alignfl.plugins.options import option, option_from
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm


@dataclass(frozen=True)
class FedAvgMSettings:
    fedavgm_server_lr: float = option_from(ServerStep, "server_lr")
    fedavgm_server_momentum: float = option(
        0.9, "momentum of the server's update", lambda v: 0 <= v < 1, "must lie in [0, 1)"
    )


class FedAvgM(ServerStrategy):
    """x ← x − η · m, m ← β·m + (x − mean of the clients' models), η = ``fedavgm-server-lr``, β =
    ``fedavgm-server-momentum`` (Flower's FedAvgM arithmetic; no step when η is 1 and β is 0). The momentum
    buffer is the server state."""

    state_keys = frozenset({"momentum"})

    def __init__(self, context: RunContext) -> None:
        super().__init__(context)
        self.momentum: dict[str, np.ndarray] | None = None

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge:
        average = weighted_mean(replies)
        lr, beta = self.settings.fedavgm_server_lr, self.settings.fedavgm_server_momentum
        if lr == 1.0 and beta == 0.0:
            return Merge(average)
        step = {key: reference[key].numpy() - average[key].numpy() for key in average}
        if beta > 0.0:
            self.momentum = step if self.momentum is None else {k: beta * self.momentum[k] + step[k] for k in step}
            step = self.momentum
        return Merge(ArrayRecord({key: Array(np.asarray(reference[key].numpy() - lr * step[key])) for key in average}))

    def state_dict(self) -> dict[str, Any]:
        return {} if self.momentum is None else {"momentum": {k: torch.from_numpy(v) for k, v in self.momentum.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        momentum = state.get("momentum")
        self.momentum = None if momentum is None else {k: v.numpy() for k, v in momentum.items()}


STRATEGIES.register(
    Algorithm(
        "fedavgm",
        FedAvgM,
        LocalUpdate,
        "FedAvg with server momentum (fedavgm-server-lr, fedavgm-server-momentum)",
        FedAvgMSettings,
        paper="Hsu, Qi and Brown, Measuring the Effects of Non-Identical Data Distribution for Federated Visual "
        "Classification, arXiv:1909.06335, 2019",
        renamed={"server-lr": "fedavgm-server-lr", "server-momentum": "fedavgm-server-momentum"},
    )
)
