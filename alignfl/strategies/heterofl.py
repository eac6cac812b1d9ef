"""HeteroFL: clients of different widths train the first units of every layer of the global model (Diao, Ding &
Tarokh, "HeteroFL: Computation and Communication Efficient Federated Learning for Heterogeneous Clients",
ICLR 2021, arXiv:2010.01264).

A client of width rate ``r`` (``client-widths`` over ``global-width``, :mod:`alignfl.core.widths`) receives the first
units of every permutation group of the global model (every hidden layer's first ``round(r J)`` units or
channels as its model builds them; input and output layers whole) and replies at that width. Each global entry is
the weighted mean over the clients whose sub-model holds it; an entry no client holds keeps its value. During
local training every hidden layer's output is divided by ``r`` (the authors' *scaler*,
``heterofl-scaler``), so a narrower sub-model's activations keep the global model's scale; evaluation runs
unscaled.

With ``repair=on`` (:mod:`alignfl.core.rounds.repair_round`) a unit is renormalised to the statistics of the clients
whose sub-model holds it, measured on those clients' data (the scaler is off then, as in evaluation).

Where this differs from the authors' code:

* The mean is weighted by the run's ``server-weighting`` (examples by default, as every strategy here);
  ``server-weighting=uniform`` gives the authors' count-based mean.
* Their static BatchNorm (no running statistics while training, re-estimated for evaluation) and their masking
  of the classifier's rows and logits to a client's own classes in non-IID runs are not done: BatchNorm keeps
  its running statistics like any other per-channel entry, and the classifier is averaged over every client.
* The scaler wraps the layers that run their own forward pass (linear and conv layers: MLPs, VGG, ResNet,
  MobileNet); Psi-Net's grouped layers, whose group weights are concatenated by their parent, are not scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord
from torch import Tensor, nn

from alignfl.core.rounds.replies import CONFIG_RECORD
from alignfl.core.rounds.strategy import Merge, Reply, RunContext, ServerStrategy, states_and_weights
from alignfl.core.rounds.sub_models import ClientWidths
from alignfl.core.widths import WIDTH_RATE
from alignfl.plugins.options import option
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm


@dataclass(frozen=True)
class HeteroFLSettings:
    heterofl_scaler: bool = option(True, "divide hidden layers' outputs by the width rate while training")


def nested_mean(
    reference: dict[str, Tensor], states: list[dict[str, Tensor]], weights: list[float]
) -> dict[str, Tensor]:
    """Every entry of ``reference`` replaced, index by index, by the weighted mean of the states that hold that
    index (each state holds the first indices along every axis); indices nobody holds keep their value."""
    fused: dict[str, Tensor] = {}
    for key, value in reference.items():
        total, count = torch.zeros_like(value, dtype=torch.float64), torch.zeros_like(value, dtype=torch.float64)
        for state, weight in zip(states, weights):
            region = tuple(slice(0, n) for n in state[key].shape)
            total[region] += weight * state[key].double()
            count[region] += weight
        fused[key] = torch.where(count > 0, total / count.clamp(min=1e-300), value.double()).to(value.dtype)
    return fused


class HeteroFL(ServerStrategy):
    """Sub-models of the first units, averaged where they overlap (module notes)."""

    mixed_widths = True
    repairable = True  # unit i of every sub-model is unit i of the global model

    def __init__(self, context: RunContext) -> None:
        super().__init__(context)
        self.client_widths = ClientWidths(
            context.config, context.spec, context.initial_arrays.to_torch_state_dict(), nested=True
        )  # sub-models: the first units (ServerStrategy.narrow)

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge:
        """The nested mean: a narrower reply's units are the first ones, so no unit moves."""
        return Merge(ArrayRecord(nested_mean(reference.to_torch_state_dict(), *states_and_weights(replies))))


def hidden_layers(model: nn.Module) -> list[nn.Module]:
    """The linear and conv layers whose outputs are hidden units (axis 0 of their weight is a permutation group)."""
    if not hasattr(model, "permutation_spec"):
        return []
    keys = {ref.key for refs in model.permutation_spec().groups.values() for ref in refs if ref.axis == 0}
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)) and f"{name}.weight" in keys:
            layers.append(module)
    return layers


class HeteroFLUpdate(LocalUpdate):
    """FedAvg's local SGD with the scaler on the hidden layers (rate from the training message's config)."""

    not_vectorised = "clients train sub-models of different widths, each with its own scaler"

    def train(self, model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, float]:
        config = self.received.get(CONFIG_RECORD, {})
        rate = float(config.get(WIDTH_RATE, 1.0))
        hooks = []
        if self.settings.heterofl_scaler and rate != 1.0:

            def scale(module: nn.Module, inputs: Any, output: Tensor) -> Tensor:
                return output / rate if module.training else output

            hooks = [layer.register_forward_hook(scale) for layer in hidden_layers(model)]
        try:
            return super().train(model, *args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()


STRATEGIES.register(
    Algorithm(
        "heterofl",
        HeteroFL,
        HeteroFLUpdate,
        "HeteroFL: clients of different widths train the global model's first units; overlapping entries averaged",
        HeteroFLSettings,
        paper="Diao, Ding and Tarokh, HeteroFL: Computation and Communication Efficient Federated Learning for "
        "Heterogeneous Clients, ICLR 2021",
    )
)
