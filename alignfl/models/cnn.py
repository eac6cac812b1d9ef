"""Plain conv nets (conv -> [norm ->] PAN -> ReLU [-> max-pool], then fully connected layers).

:class:`ConvStack` is the forward pass every conv net here shares (this module's
:class:`PlainConvNet` and the Ψ-Net of :mod:`alignfl.models.psinet`); :class:`PlainConvNet`
is used by the FedAvg paper's CNN (``twocnn``, here) and the VGG family
(:mod:`alignfl.models.vgg`). State-dict keys: ``convs.{i}``, ``norms.{i}`` (only with a
norm that has state), ``fcs.{i}`` (hidden fully connected layers) and ``classifier``.

Normalisation (:data:`NORMS`): ``none`` (the VGG default), ``bn`` (BatchNorm) or
``gn`` (GroupNorm) after every conv, before the PAN. The GroupNorm has **one group**
(the statistics of a sample over all channels of the layer). The Fed2 paper (Yu et al.,
KDD 2021) does not say how many groups its FedAvg+GN ablation uses; one group keeps every permutation of a
layer's channels a symmetry of the net (with G > 1 groups only permutations inside
a group and of whole groups are), which the matching strategies and analysis tools
rely on. Hidden FCs never get a norm.

Small inputs: a 2x2 max-pool that would shrink a side below 1 pixel (a side
already smaller than 2) is skipped. This is what lets VGG-11's five pools run on
8x8 digits (8 -> 4 -> 2 -> 1, then two skipped) and on 28x28 images (the last
pool sees 1x1). The plan is fixed at construction from ``input_shape``, so the
flattened feature size is known without a dummy forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignfl.models.options import BiasOptions
from alignfl.models.pan import PanSettings, PositionEncoding
from alignfl.models.permutation import AxisRef, PermutationSpec, inputs_of, outputs_of
from alignfl.models.registry import MODELS, InputShape, Model

POOL = "M"
NORMS: dict[str, Callable[[int], nn.Module]] = {
    "none": lambda width: nn.Identity(),
    "bn": nn.BatchNorm2d,
    "gn": lambda width: nn.GroupNorm(1, width),
}
"""Normalisation after each conv, by name: ``width -> module``."""


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


def scale_widths(config: Sequence[int | str], factor: float) -> tuple[int | str, ...]:
    """A conv config or hidden-width tuple with every width times ``factor`` (rounded, at least 1).

    Narrow nets (``factor < 1``) are how the conv nets fit a small CPU; 1 is the published width.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"width-factor must be a finite number > 0, got {factor!r}")
    return tuple(item if item == POOL else max(1, round(int(item) * factor)) for item in config)


def norm_entries(prefix: str, norm: nn.Module) -> tuple[AxisRef, ...]:
    """Every per-channel entry of a norm layer (BN: scale, shift, running stats; GN: scale, shift;
    none: nothing). ``num_batches_tracked`` is a 0-d counter and never moves."""
    return tuple(AxisRef(f"{prefix}.{name}", 0) for name, tensor in norm.state_dict().items() if tensor.dim() == 1)


class ConvStack(nn.Module):
    """The forward pass shared by the conv nets: ``convs``/``norms``/``conv_pans`` with ``pool_after``,
    flatten, ``fcs``/``fc_pans``, ``classifier``. Subclasses build those modules."""

    convs: nn.ModuleList
    norms: nn.ModuleList
    conv_pans: nn.ModuleList
    pool_after: tuple[bool, ...]
    fcs: nn.ModuleList
    fc_pans: nn.ModuleList
    classifier: nn.Module

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.representation(x))

    def representation(self, x: Tensor) -> Tensor:
        """The classifier's input: the last hidden FC's activations, or the flattened features (MOON contrasts these)."""
        for conv, norm, pan, pool in zip(self.convs, self.norms, self.conv_pans, self.pool_after, strict=True):
            x = F.relu(pan(norm(conv(x))))
            if pool:
                x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        for fc, pan in zip(self.fcs, self.fc_pans, strict=True):
            x = F.relu(pan(fc(x)))
        return x


class PlainConvNet(ConvStack):
    """Conv layers with optional norms and 2x2 max-pools, then hidden FC layers, then a classifier.

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
        Applied after every conv (and its norm) and hidden FC, before its ReLU.
    norm : str
        A name from :data:`NORMS`.
    bias : bool
        Whether convs and linear layers have biases (the SuPerFed authors' TwoCNN has none).
    """

    def __init__(
        self,
        input_shape: InputShape,
        num_classes: int,
        config: Sequence[int | str],
        hidden: tuple[int, ...],
        kernel_size: int,
        pan: PanSettings,
        norm: str = "none",
        bias: bool = True,
    ) -> None:
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"unknown norm {norm!r}; allowed: {sorted(NORMS)}")
        channels, height, width = input_shape
        plan = conv_plan(config)
        widths = [channels] + [w for w, _ in plan]
        self.convs = nn.ModuleList(
            nn.Conv2d(c_in, c_out, kernel_size, padding=kernel_size // 2, bias=bias)
            for c_in, c_out in zip(widths, widths[1:])
        )
        self.norms = nn.ModuleList(NORMS[norm](w) for w in widths[1:])
        self.conv_pans = nn.ModuleList(PositionEncoding(w, pan) for w in widths[1:])
        self.pool_after, self.spatial = pooling_plan([wants for _, wants in plan], height, width)
        features = [widths[-1] * self.spatial] + list(hidden)
        self.fcs = nn.ModuleList(nn.Linear(n_in, n_out, bias=bias) for n_in, n_out in zip(features, features[1:]))
        self.fc_pans = nn.ModuleList(PositionEncoding(n, pan) for n in hidden)
        self.classifier = nn.Linear(features[-1], num_classes, bias=bias)
        self.bias = bias
        self._spec = self._build_spec()

    def permutation_spec(self) -> PermutationSpec:
        """One group per conv (its output channels, with its norm's entries) and per hidden FC (its units).

        The last conv's channels reach the first FC through the flatten, so that
        FC's input axis is recorded with ``block = H*W`` of the final feature map.
        """
        return self._spec

    def _build_spec(self) -> PermutationSpec:
        layers = [f"convs.{i}" for i in range(len(self.convs))] + [f"fcs.{i}" for i in range(len(self.fcs))]
        norms = [norm_entries(f"norms.{i}", norm) for i, norm in enumerate(self.norms)] + [()] * len(self.fcs)
        consumers = layers[1:] + ["classifier"]
        last_conv = len(self.convs) - 1
        groups = {
            name: outputs_of(name, self.bias) + norm + inputs_of(nxt, self.spatial if i == last_conv else 1)
            for i, (name, norm, nxt) in enumerate(zip(layers, norms, consumers))
        }
        return PermutationSpec(groups)


def twocnn(input_shape: InputShape, num_classes: int, pan: PanSettings, bias: bool) -> PlainConvNet:
    """FedAvg paper's CNN: 5x5 conv 32, pool, 5x5 conv 64, pool, FC 512 (padding 2 so 8x8 works)."""
    return PlainConvNet(input_shape, num_classes, (32, POOL, 64, POOL), (512,), 5, pan, bias=bias)


MODELS.register(Model("twocnn", twocnn, BiasOptions))
