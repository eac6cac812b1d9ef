"""Plain conv nets (conv -> PAN -> ReLU [-> max-pool], then fully connected layers).

:class:`PlainConvNet` is shared by the FedAvg paper's CNN (``twocnn``, here) and
the VGG family (:mod:`models.vgg`). State-dict keys: ``convs.{i}``, ``fcs.{i}``
(hidden fully connected layers) and ``classifier``.

Small inputs: a 2x2 max-pool that would shrink a side below 1 pixel (a side
already smaller than 2) is skipped. This is what lets VGG-11's five pools run on
8x8 digits (8 -> 4 -> 2 -> 1, then two skipped) and on 28x28 images (the last
pool sees 1x1). The plan is fixed at construction from ``input_shape``, so the
flattened feature size is known without a dummy forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.pan import PanSettings, PositionEncoding
from models.permutation import PermutationSpec, inputs_of, outputs_of
from models.registry import InputShape, register_model

POOL = "M"


def conv_plan(config: Sequence[int | str]) -> list[tuple[int, bool]]:
    """Turn a VGG-style config (widths and ``"M"``) into ``[(width, pool_after), ...]``."""
    plan: list[tuple[int, bool]] = []
    for item in config:
        if item == POOL:
            if not plan or plan[-1][1]:
                raise ValueError(f"each 'M' in a conv config must follow a conv width, got {list(config)}")
            plan[-1] = (plan[-1][0], True)
        else:
            plan.append((int(item), False))
    return plan


def pooling_plan(wanted: Sequence[bool], height: int, width: int) -> tuple[tuple[bool, ...], int]:
    """Which requested 2x2 pools actually run, and the final ``H*W``.

    A pool is skipped when a side is already below 2 pixels, since it would
    produce an empty feature map.
    """
    flags: list[bool] = []
    for wants in wanted:
        runs = wants and min(height, width) >= 2
        if runs:
            height, width = height // 2, width // 2
        flags.append(runs)
    return tuple(flags), height * width


class PlainConvNet(nn.Module):
    """Conv layers with optional 2x2 max-pools, then hidden FC layers, then a classifier.

    Parameters
    ----------
    input_shape : (C, H, W)
        Shape of one input sample.
    num_classes : int
        Output logits.
    config : sequence of int or "M"
        Conv output widths, ``"M"`` for a 2x2 max-pool after the preceding conv.
    hidden : tuple of int
        Widths of the fully connected layers between the flatten and the classifier.
    kernel_size : int
        Odd square kernel; padding ``kernel_size // 2`` keeps the spatial size.
    pan : PanSettings
        Applied after every conv and hidden FC, before its ReLU.
    """

    def __init__(
        self,
        input_shape: InputShape,
        num_classes: int,
        config: Sequence[int | str],
        hidden: tuple[int, ...],
        kernel_size: int,
        pan: PanSettings,
    ) -> None:
        super().__init__()
        channels, height, width = input_shape
        plan = conv_plan(config)
        widths = [channels] + [w for w, _ in plan]
        self.convs = nn.ModuleList(
            nn.Conv2d(c_in, c_out, kernel_size, padding=kernel_size // 2) for c_in, c_out in zip(widths, widths[1:])
        )
        self.conv_pans = nn.ModuleList(PositionEncoding(w, pan) for w in widths[1:])
        self.pool_after, self.spatial = pooling_plan([wants for _, wants in plan], height, width)
        features = [widths[-1] * self.spatial] + list(hidden)
        self.fcs = nn.ModuleList(nn.Linear(n_in, n_out) for n_in, n_out in zip(features, features[1:]))
        self.fc_pans = nn.ModuleList(PositionEncoding(n, pan) for n in hidden)
        self.classifier = nn.Linear(features[-1], num_classes)
        self._spec = self._build_spec()

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.representation(x))

    def representation(self, x: Tensor) -> Tensor:
        """The classifier's input: the last hidden FC's activations, or the flattened features (MOON contrasts these)."""
        for conv, pan, pool in zip(self.convs, self.conv_pans, self.pool_after):
            x = F.relu(pan(conv(x)))
            if pool:
                x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        for fc, pan in zip(self.fcs, self.fc_pans):
            x = F.relu(pan(fc(x)))
        return x

    def permutation_spec(self) -> PermutationSpec:
        """One group per conv (its output channels) and per hidden FC (its units).

        The last conv's channels reach the first FC through the flatten, so that
        FC's input axis is recorded with ``block = H*W`` of the final feature map.
        """
        return self._spec

    def _build_spec(self) -> PermutationSpec:
        layers = [f"convs.{i}" for i in range(len(self.convs))] + [f"fcs.{i}" for i in range(len(self.fcs))]
        consumers = layers[1:] + ["classifier"]
        last_conv = len(self.convs) - 1
        groups = {
            name: outputs_of(name) + inputs_of(nxt, self.spatial if i == last_conv else 1)
            for i, (name, nxt) in enumerate(zip(layers, consumers))
        }
        return PermutationSpec(groups)


@register_model("twocnn")
def twocnn(input_shape: InputShape, num_classes: int, pan: PanSettings) -> PlainConvNet:
    """FedAvg paper's CNN: 5x5 conv 32, pool, 5x5 conv 64, pool, FC 512 (padding 2 so 8x8 works)."""
    return PlainConvNet(input_shape, num_classes, (32, POOL, 64, POOL), (512,), 5, pan)
