"""Fully connected networks: the PANs paper's MLP, FedMA's small MLP and FedAvg's 2NN.

State-dict keys: ``hidden.{i}.weight/bias`` for hidden layer ``i`` and
``classifier.weight/bias`` for the output layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignfl.models.cnn import scale_widths
from alignfl.models.options import BiasOptions, WidthOptions
from alignfl.models.pan import PanSettings, PositionEncoding
from alignfl.models.permutation import PermutationSpec, inputs_of, outputs_of
from alignfl.models.registry import MODELS, InputShape, Model
from alignfl.plugins.options import option


class MLP(nn.Module):
    """Flatten -> [Linear -> PAN -> ReLU] per hidden width -> Linear.

    Parameters
    ----------
    input_shape : (C, H, W)
        Flattened to ``C*H*W`` input features.
    num_classes : int
        Output logits.
    hidden : tuple of int
        Width of each hidden layer, input side first.
    pan : PanSettings
        Position encoding applied after each hidden linear, before its ReLU.
    bias : bool
        Whether every linear layer has a bias (the SuPerFed authors' TwoNN has none).
    """

    def __init__(
        self, input_shape: InputShape, num_classes: int, hidden: tuple[int, ...], pan: PanSettings, bias: bool = True
    ) -> None:
        super().__init__()
        widths = (math.prod(input_shape),) + tuple(hidden)
        self.bias = bias
        self.hidden = nn.ModuleList(nn.Linear(n_in, n_out, bias=bias) for n_in, n_out in zip(widths, widths[1:]))
        self.pans = nn.ModuleList(PositionEncoding(n, pan) for n in hidden)
        self.classifier = nn.Linear(widths[-1], num_classes, bias=bias)
        self._spec = self._build_spec()

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.representation(x))

    def representation(self, x: Tensor) -> Tensor:
        """The classifier's input: the last hidden layer's activations (MOON contrasts these)."""
        x = torch.flatten(x, 1)
        for linear, pan in zip(self.hidden, self.pans):
            x = F.relu(pan(linear(x)))
        return x

    def permutation_spec(self) -> PermutationSpec:
        """Hidden layer ``i``'s units: its rows and bias, and the next layer's columns."""
        return self._spec

    def _build_spec(self) -> PermutationSpec:
        names = [f"hidden.{i}" for i in range(len(self.hidden))] + ["classifier"]
        return PermutationSpec(
            {name: outputs_of(name, self.bias) + inputs_of(nxt) for name, nxt in zip(names, names[1:])}
        )


def _hidden(widths: tuple[int, ...], width_factor: float) -> tuple[int, ...]:
    return tuple(int(w) for w in scale_widths(widths, width_factor))


def mlp(input_shape: InputShape, num_classes: int, pan: PanSettings) -> MLP:
    """PANs paper MLP: 1024-1024-1024 hidden units (no width option: a run's default model has no options)."""
    return MLP(input_shape, num_classes, (1024, 1024, 1024), pan)


MODELS.register(Model("mlp", mlp))


def small_mlp(input_shape: InputShape, num_classes: int, pan: PanSettings, width_factor: float) -> MLP:
    """FedMA study MLP: 20-100-120-84 hidden units (times ``width_factor``)."""
    return MLP(input_shape, num_classes, _hidden((20, 100, 120, 84), width_factor), pan)


MODELS.register(Model("small-mlp", small_mlp, WidthOptions))


@dataclass(frozen=True)
class TwoNNOptions(BiasOptions, WidthOptions):
    hidden_layers: int = option(
        2,
        "hidden layers of 200 units (2: FedAvg's 2NN; 3: the SuPerFed authors' TwoNN)",
        lambda v: v >= 1,
        "must be an integer >= 1",
    )


def twonn(
    input_shape: InputShape, num_classes: int, pan: PanSettings, bias: bool, width_factor: float, hidden_layers: int
) -> MLP:
    """FedAvg paper's 2NN: 200-200 hidden units (times ``width_factor``); with ``hidden-layers=3 bias=false`` the
    SuPerFed authors' 784-200-200-200-C net."""
    return MLP(input_shape, num_classes, _hidden((200,) * hidden_layers, width_factor), pan, bias)


MODELS.register(Model("twonn", twonn, TwoNNOptions))
