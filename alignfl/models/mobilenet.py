"""MobileNetV1 and its Ψ-Net form (Fed2 evaluates Ψ-Net on MobileNetV1).

Howard et al., "MobileNets: Efficient Convolutional Neural Networks for Mobile Vision
Applications", arXiv:1704.04861, 2017; Yu et al., "Fed2: Feature-Aligned Federated
Learning", KDD 2021.

Structure: a 3x3 conv (32 channels), then 13 depthwise-separable blocks (a 3x3
depthwise conv, one filter per channel, then a 1x1 pointwise conv; each conv
followed by its norm, a PAN and a ReLU), global average pooling and one linear
classifier. Convs have no bias where a norm follows them. The ``width_factor``
option (run-config ``width-factor``) is Howard's width multiplier α: every width
times α, rounded, at least 1.

Small inputs: the ImageNet net halves the resolution five times (stem and four
blocks), which would leave the last blocks 1x1 maps on 28x28 and 32x32 images
(32 -> 16 -> 8 -> 4 -> 2 -> 1). Here the stem has stride 1 and only the four stride-2 *blocks* halve,
as in the usual CIFAR ports, and a stride-2 block runs with stride 1 where
halving would leave a side below 2 pixels (:func:`stride_plan`): on a 1x1 map a
3x3 depthwise conv degenerates to a per-channel scale, and a deep stack of those
drowns the input's signal. So 32 -> 16 -> 8 -> 4 -> 2, 28 -> 14 -> 7 -> 4 -> 2,
and 8 -> 4 -> 2 (the last two halvings skipped). A stride-2 3x3 conv with
padding 1 maps a side ``n`` to ``ceil(n / 2)``. The last depthwise conv has
stride 1 (Howard's table prints s2 there, a known typo: its output stays 7x7).

PANs: one :class:`~alignfl.models.pan.PositionEncoding` after every conv's norm, before
its ReLU (stem, every depthwise and every pointwise conv), as ResNet does.

Permutation symmetry: a depthwise conv's channel ``j`` filters only input
channel ``j``, so its channels are not units of their own: the group of a
pointwise conv's (or the stem's) output channels runs through the next depthwise
conv (weight axis 0), its norm, and ends at the next pointwise conv's input axis
(or the classifier's, after the pooling). The analysis tools therefore read a
group's activations at that pointwise input, i.e. after the depthwise conv.

State-dict keys: ``stem.conv``/``stem.norm``, ``blocks.{i}.dw.conv``/``.dw.norm``,
``blocks.{i}.pw.conv``/``.pw.norm``, ``classifier``.

Ψ-Net form (``psi-mobilenet``, :class:`PsiMobileNet`): the stem and the first
``psi_depth`` blocks are shared (BatchNorm). From block ``psi_depth`` on, every
pointwise conv is a group conv with ``G`` groups and every depthwise conv stays
per channel, so each is split along the same ``G`` channel groups; GroupNorm
with ``G`` groups follows both; the classifier is ``G`` heads. The first grouped
block's depthwise conv still filters the *shared* channels, so it is shared
(with BatchNorm); its pointwise conv is where the net branches (every group reads
all shared channels), as the first grouped conv of :mod:`alignfl.models.psinet`. Grouped
modules store one sub-module per group (``groups.{g}``), so
:func:`alignfl.models.psinet.group_layout`, the ``psinet`` strategy's trimming and
aggregation, and :attr:`PsiMobileNet.class_groups` work as for the Ψ-VGGs.
Grouped widths are ``ceil(w / G)`` per group; grouped pointwise convs are
:class:`alignfl.models.psinet.GroupedConv2d` and so keep its per-group bias. ``psi_depth``
counts blocks (0 to 13; the run config's default 2 shares the stem and the
32/64-channel blocks); the Fed2 paper names MobileNetV1 but gives neither its depth
nor its input adaptation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignfl.models.cnn import norm_entries, scale_widths
from alignfl.models.options import WidthOptions
from alignfl.models.pan import PanSettings, PositionEncoding
from alignfl.models.permutation import AxisRef, PermutationSpec, inputs_of
from alignfl.models.psinet import (
    GroupedConv2d,
    GroupedHeads,
    GroupedNorm,
    GroupLayout,
    PsiOptions,
    class_group_spec,
    contiguous_class_groups,
    group_layout,
)
from alignfl.models.registry import MODELS, InputShape, Model

STEM_WIDTH = 32
BLOCKS: tuple[tuple[int, int], ...] = (
    (64, 1),
    (128, 2),
    (128, 1),
    (256, 2),
    (256, 1),
    (512, 2),
    (512, 1),
    (512, 1),
    (512, 1),
    (512, 1),
    (512, 1),
    (1024, 2),
    (1024, 1),
)
"""``(pointwise width, depthwise stride)`` of the 13 depthwise-separable blocks (Howard et al., Table 1)."""


class ConvUnit(nn.Module):
    """conv -> norm -> PAN -> ReLU: one hidden layer."""

    def __init__(self, conv: nn.Module, norm: nn.Module, width: int, pan: PanSettings) -> None:
        super().__init__()
        self.conv, self.norm, self.pan = conv, norm, PositionEncoding(width, pan)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.pan(self.norm(self.conv(x))))


class SeparableBlock(nn.Module):
    """A depthwise unit followed by a pointwise unit."""

    def __init__(self, dw: ConvUnit, pw: ConvUnit) -> None:
        super().__init__()
        self.dw, self.pw = dw, pw

    def forward(self, x: Tensor) -> Tensor:
        return self.pw(self.dw(x))


class GroupedDepthwise(nn.Module):
    """A depthwise 3x3 conv over ``G`` channel groups stored as ``groups.{g}`` (so the layout can split it),
    run as one depthwise conv. Never a hook site of the analysis tools (see the module notes)."""

    def __init__(self, group_width: int, num_groups: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.groups = nn.ModuleList(_depthwise(group_width, stride) for _ in range(num_groups))

    def forward(self, x: Tensor) -> Tensor:
        weight = torch.cat([conv.weight for conv in self.groups])
        return F.conv2d(x, weight, None, self.stride, 1, groups=weight.shape[0])


def stride_plan(height: int, width: int) -> tuple[int, ...]:
    """The stride each block's depthwise conv runs with: 2 where :data:`BLOCKS` asks for it and both sides
    are at least 3 pixels (so the halved map keeps sides >= 2), else 1."""
    strides = []
    for _, wanted in BLOCKS:
        stride = 2 if wanted == 2 and min(height, width) >= 3 else 1
        height, width = -(-height // stride), -(-width // stride)
        strides.append(stride)
    return tuple(strides)


def _depthwise(channels: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(channels, channels, 3, stride, 1, groups=channels, bias=False)


def _shared_unit(conv: nn.Conv2d, pan: PanSettings) -> ConvUnit:
    return ConvUnit(conv, nn.BatchNorm2d(conv.out_channels), conv.out_channels, pan)


def _stem(in_channels: int, width: int, pan: PanSettings) -> ConvUnit:
    """The first 3x3 conv, stride 1 (see the module notes)."""
    return _shared_unit(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), pan)


def _shared_block(c_in: int, c_out: int, stride: int, pan: PanSettings) -> SeparableBlock:
    return SeparableBlock(
        _shared_unit(_depthwise(c_in, stride), pan), _shared_unit(nn.Conv2d(c_in, c_out, 1, bias=False), pan)
    )


class SeparableNet(nn.Module):
    """Forward pass shared by :class:`MobileNet` and :class:`PsiMobileNet`: stem, blocks, average pool, classifier."""

    stem: ConvUnit
    blocks: nn.ModuleList
    classifier: nn.Module
    _spec: PermutationSpec

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.representation(x))

    def representation(self, x: Tensor) -> Tensor:
        """The classifier's input: the last block's channels averaged over space (MOON contrasts these)."""
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return F.adaptive_avg_pool2d(x, 1).flatten(1)

    def permutation_spec(self) -> PermutationSpec:
        """One group per stem/pointwise output, carried through the next depthwise conv (module notes)."""
        return self._spec


def _unit_outputs(prefix: str, unit: ConvUnit) -> tuple[AxisRef, ...]:
    """A shared unit's output axes: conv weight (and bias) axis 0 and every per-channel norm entry."""
    refs = tuple(AxisRef(f"{prefix}.conv.{name}", 0) for name, _ in unit.conv.named_parameters())
    return refs + norm_entries(f"{prefix}.norm", unit.norm)


def _group_outputs(prefix: str, unit: ConvUnit, g: int) -> tuple[AxisRef, ...]:
    """Group ``g``'s output axes in a grouped unit: its conv's and its GroupNorm's entries."""
    conv, norm = unit.conv.groups[g], unit.norm.groups[g]
    refs = tuple(AxisRef(f"{prefix}.conv.groups.{g}.{name}", 0) for name, _ in conv.named_parameters())
    return refs + norm_entries(f"{prefix}.norm.groups.{g}", norm)


class MobileNet(SeparableNet):
    """MobileNetV1 for small images (see the module notes).

    Parameters
    ----------
    input_shape : (C, H, W)
        Shape of one input sample; any ``H, W >= 1``.
    num_classes : int
        Output logits.
    widths : sequence of int
        The stem's width, then the 13 blocks' pointwise widths.
    pan : PanSettings
        Applied after every conv's BatchNorm.
    """

    def __init__(self, input_shape: InputShape, num_classes: int, widths: Sequence[int], pan: PanSettings) -> None:
        super().__init__()
        self.stem = _stem(input_shape[0], widths[0], pan)
        self.blocks = nn.ModuleList(
            _shared_block(c_in, c_out, stride, pan)
            for c_in, c_out, stride in zip(widths[:-1], widths[1:], stride_plan(*input_shape[1:]), strict=True)
        )
        self.classifier = nn.Linear(widths[-1], num_classes)
        self._spec = self._build_spec()

    def _build_spec(self) -> PermutationSpec:
        last = len(self.blocks)
        groups: dict[str, tuple[AxisRef, ...]] = {}
        for i, name in enumerate(["stem"] + [f"blocks.{i}.pw" for i in range(last)]):
            reads = (
                inputs_of("classifier")
                if i == last
                else _unit_outputs(f"blocks.{i}.dw", self.blocks[i].dw) + inputs_of(f"blocks.{i}.pw.conv")
            )
            groups[name] = _unit_outputs(name, self.get_submodule(name)) + reads
        return PermutationSpec(groups)


class PsiMobileNet(SeparableNet):
    """MobileNetV1 in Ψ-Net form (see the module notes).

    Parameters
    ----------
    input_shape, num_classes, widths, pan
        As :class:`MobileNet`.
    num_groups : int
        ``G``; 0 means one group per class.
    depth : int
        Number of shared blocks after the (always shared) stem, in ``[0, 13]``;
        the classifier is always grouped.
    """

    def __init__(
        self,
        input_shape: InputShape,
        num_classes: int,
        widths: Sequence[int],
        pan: PanSettings,
        num_groups: int,
        depth: int,
    ) -> None:
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= len(BLOCKS):
            raise ValueError(
                f"psi-depth must be an int in [0, {len(BLOCKS)}] (the blocks of MobileNetV1), got {depth!r}"
            )
        groups = num_classes if num_groups == 0 else num_groups
        self.class_groups = contiguous_class_groups(num_classes, groups)
        self.num_groups, self.depth = groups, depth
        self.stem = _stem(input_shape[0], widths[0], pan)
        self.blocks = nn.ModuleList()
        c_in = widths[0]
        for i, (c_out, stride) in enumerate(zip(widths[1:], stride_plan(*input_shape[1:]), strict=True)):
            self.blocks.append(self._block(i, c_in, c_out, stride, pan))
            c_in = c_out if i < depth else math.ceil(c_out / groups) * groups
        self.classifier = GroupedHeads(c_in, self.class_groups, branching=depth == len(BLOCKS))
        self._spec = self._build_spec()

    def _block(self, index: int, c_in: int, c_out: int, stride: int, pan: PanSettings) -> SeparableBlock:
        """Block ``index``: shared below the depth; at the depth a shared depthwise conv and a branching
        pointwise one; above it both split into the ``G`` groups."""
        if index < self.depth:
            return _shared_block(c_in, c_out, stride, pan)
        groups, width = self.num_groups, math.ceil(c_out / self.num_groups)
        if index == self.depth:
            dw = _shared_unit(_depthwise(c_in, stride), pan)
        else:
            dw = ConvUnit(
                GroupedDepthwise(c_in // groups, groups, stride), GroupedNorm(c_in // groups, groups), c_in, pan
            )
        pw = ConvUnit(
            GroupedConv2d(c_in, width, groups, 1, branching=index == self.depth),
            GroupedNorm(width, groups),
            width * groups,
            pan,
        )
        return SeparableBlock(dw, pw)

    def layout(self) -> GroupLayout:
        """Shared and per-group keys of this model's federated (floating-point) state."""
        return group_layout(k for k, v in self.state_dict().items() if torch.is_floating_point(v))

    def _build_spec(self) -> PermutationSpec:
        """Shared producers: one group each, read by the next shared depthwise conv and then by the next
        pointwise conv or every branch of it. Grouped producers: one group per (block, group)."""
        last = len(self.blocks)
        spec: dict[str, tuple[AxisRef, ...]] = {}
        for i, name in enumerate(["stem"] + [f"blocks.{i}.pw" for i in range(last)]):
            unit = self.get_submodule(name)
            if i <= self.depth:  # the stem, or a shared block's pointwise conv
                through = () if i == last else _unit_outputs(f"blocks.{i}.dw", self.blocks[i].dw)
                consumer = "classifier" if i == last else f"blocks.{i}.pw.conv"
                readers = [f"{consumer}.groups.{g}" for g in range(self.num_groups)] if i == self.depth else [consumer]
                spec[name] = _unit_outputs(name, unit) + through + tuple(r for c in readers for r in inputs_of(c))
                continue
            for g in range(self.num_groups):
                reads = (
                    inputs_of(f"classifier.groups.{g}")
                    if i == last
                    else _group_outputs(f"blocks.{i}.dw", self.blocks[i].dw, g)
                    + inputs_of(f"blocks.{i}.pw.conv.groups.{g}")
                )
                spec[f"{name}.groups.{g}"] = _group_outputs(name, unit, g) + reads
        return class_group_spec(spec)


def _widths(width_factor: float) -> tuple[int, ...]:
    """The stem's and the blocks' widths times ``width_factor``."""
    return tuple(int(w) for w in scale_widths((STEM_WIDTH, *(w for w, _ in BLOCKS)), width_factor))


def mobilenet(input_shape: InputShape, num_classes: int, pan: PanSettings, width_factor: float) -> MobileNet:
    """MobileNetV1 (stem 32, blocks 64 ... 1024, each times ``width_factor``), strides for small images."""
    return MobileNet(input_shape, num_classes, _widths(width_factor), pan)


MODELS.register(Model("mobilenet", mobilenet, WidthOptions))


def psi_mobilenet(
    input_shape: InputShape, num_classes: int, pan: PanSettings, psi_groups: int, psi_depth: int, width_factor: float
) -> PsiMobileNet:
    """MobileNetV1 in Ψ-Net form: stem and the first ``psi_depth`` blocks shared, the rest in ``psi_groups`` groups."""
    return PsiMobileNet(input_shape, num_classes, _widths(width_factor), pan, psi_groups, psi_depth)


MODELS.register(Model("psi-mobilenet", psi_mobilenet, PsiOptions))
