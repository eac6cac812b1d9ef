"""FedAvgM (Hsu et al., 2019): the server applies the averaged update with momentum."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvgM as FlowerFedAvgM

from fl_app.config import RunConfig
from strategies.base import LocalUpdate, MetricAggregation, StrategyBase, flower_strategy_kwargs
from strategies.registry import StrategyEntry, register_strategy


class FedAvgM(StrategyBase, FlowerFedAvgM):
    """Flower's FedAvgM (server-lr, server-momentum) with malformed replies dropped.

    Its server state is Flower's: the model the next pseudo-gradient is taken from
    (``current_arrays``) and the momentum buffer, one array per model entry in key order.
    """

    state_keys = frozenset({"current-arrays", "momentum"})

    def state_dict(self) -> dict[str, Any]:
        if self.current_arrays is None:
            return {}
        keys = list(self.current_arrays.keys())
        state: dict[str, Any] = {"current-arrays": self.current_arrays.to_torch_state_dict()}
        if self.momentum_vector is not None:
            state["momentum"] = {key: torch.from_numpy(value) for key, value in zip(keys, self.momentum_vector,
                                                                                      strict=True)}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        self.current_arrays = ArrayRecord(dict(state["current-arrays"])) if "current-arrays" in state else None
        momentum = state.get("momentum")
        keys = list(self.current_arrays.keys()) if self.current_arrays is not None else []
        self.momentum_vector = [momentum[key].numpy() for key in keys] if momentum is not None else None


def build_server(config: RunConfig, metrics: MetricAggregation) -> FedAvgM:
    return FedAvgM(server_learning_rate=config.server_lr, server_momentum=config.server_momentum,
                   **flower_strategy_kwargs(config, metrics))


register_strategy(StrategyEntry("fedavgm", build_server, LocalUpdate,
                                "FedAvg with server momentum (server-lr, server-momentum)"))
