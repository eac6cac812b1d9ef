"""Ψ-Net form of the VGG nets (Yu et al., "Fed2: Feature-Aligned Federated Learning", KDD 2021, §3.2).

The first ``psi_depth`` hidden layers stay ordinary and shared (conv -> BatchNorm ->
PAN -> ReLU; hidden FCs without a norm, as in VGG). From layer ``psi_depth`` on
(convs first, then hidden FCs) every layer is split into ``G = psi_groups`` groups:
a group's units read only its own group's units of the previous layer, and each
grouped conv is followed by GroupNorm with the same ``G`` (so its statistics stay
inside the group). The classifier is ``G`` heads; head ``g`` reads only group ``g``
and emits only the logits of the classes mapped to ``g``. So the logit of class
``c`` depends on the shared layers and group ``g(c)`` alone, and its gradient
reaches no other group.

The first grouped layer is where the net branches: each group reads *all* the
shared layer's units (a group convolution there would tie group ``g`` to an
arbitrary ``1/G`` slice of features that every group needs).

Storage: every grouped module keeps one sub-module per group in a ModuleList
called ``groups``, so every grouped state-dict key contains ``groups.{g}.``
(``convs.3.groups.7.weight``, ``norms.3.groups.7.bias``,
``classifier.groups.7.weight``). :func:`group_layout` reads that convention from
key names alone; the client (trimming) and the server (aggregation) both use it.
Grouped convs concatenate the per-group weights and run one grouped conv, so the
split costs no extra kernels; while a hook is registered on a group's conv (the
analysis tools capture activations that way) they call each group's module
instead, so the hook fires. Grouped linears and heads always call each group's
module.

Widths: a layer of width ``w`` gets ``ceil(w / G)`` units per group, i.e. ``w``
rounded up to a multiple of ``G`` (VGG-9's 32..512 are not multiples of 10). The
``width_factor`` option scales the base widths first, as for the plain VGGs.

Class -> group mapping: contiguous, class ``c`` -> group ``c * G // C``; ``G = C``
is the one-to-one mapping, ``G < C`` one-to-many (every group gets
``floor(C/G)`` or ``ceil(C/G)`` classes). ``psi_groups = 0`` means ``G = C``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from alignfl.models.cnn import ConvStack, conv_plan, pooling_plan, scale_widths
from alignfl.models.options import WidthOptions
from alignfl.models.pan import PanSettings, PositionEncoding
from alignfl.models.permutation import AxisRef, PermutationSpec, batchnorm_of, inputs_of, outputs_of
from alignfl.models.registry import MODELS, InputShape, Model
from alignfl.models.vgg import VGG9_CONFIG, VGG9_HIDDEN, VGG11_CONFIG
from alignfl.plugins.options import option


@dataclass(frozen=True)
class PsiOptions(WidthOptions):
    """A Ψ-Net's grouping (its depth's upper bound depends on the net and is checked when it is built)."""

    psi_groups: int = option(
        0,
        "class groups of the Psi-Net (0: one group per class)",
        lambda v: v >= 0,
        "must be an integer >= 0 (0: one group per class)",
    )
    psi_depth: int = option(
        2,
        "hidden layers shared by every group (the first two convs: VGG's low-level layers)",
        lambda v: v >= 0,
        "must be an integer >= 0",
    )


_GROUP_KEY = re.compile(r"(?:^|\.)groups\.(\d+)\.")

CLASS_GROUP_WIDTH = (
    "a Psi-Net layer's class groups run as one grouped layer (one grouped conv, GroupNorm or split of the "
    "features), so all of them keep one width"
)
"""Why the permutation group of one class group of a grouped layer cannot change width on its own."""


def class_group_spec(groups: dict[str, tuple[AxisRef, ...]]) -> PermutationSpec:
    """A Ψ-Net's permutation description: ``groups``, where every group of one class group (a name with
    ``groups.{g}``) keeps its width (:data:`CLASS_GROUP_WIDTH`)."""
    return PermutationSpec(groups, {name: CLASS_GROUP_WIDTH for name in groups if _GROUP_KEY.search(f"{name}.")})


def contiguous_class_groups(num_classes: int, num_groups: int) -> tuple[int, ...]:
    """Class ``c`` -> group ``c * G // C``: contiguous blocks, every group non-empty when ``G <= C``."""
    if not 1 <= num_groups <= num_classes:
        raise ValueError(
            f"psi-groups must lie in [1, num_classes={num_classes}] (0 means one per class), got {num_groups}"
        )
    return tuple(c * num_groups // num_classes for c in range(num_classes))


@dataclass(frozen=True)
class GroupLayout:
    """Which federated state-dict keys are shared and which belong to which group.

    The one description that client trimming and server aggregation both read.
    """

    shared: tuple[str, ...]
    groups: tuple[tuple[str, ...], ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def keys_for(self, held: Iterable[int]) -> tuple[str, ...]:
        """The keys a client holding groups ``held`` trains and sends: shared ones, then its groups'."""
        held = sorted(set(held))
        bad = [g for g in held if not 0 <= g < self.num_groups]
        if bad:
            raise ValueError(f"groups {bad} do not exist; allowed: 0..{self.num_groups - 1}")
        return self.shared + tuple(key for g in held for key in self.groups[g])


def group_layout(keys: Iterable[str]) -> GroupLayout:
    """Split state-dict keys by the ``groups.{g}.`` naming convention (see the module notes).

    Raises ValueError when the group indices are not exactly ``0..G-1``.
    """
    shared: list[str] = []
    grouped: dict[int, list[str]] = {}
    for key in keys:
        match = _GROUP_KEY.search(key)
        if match is None:
            shared.append(key)
        else:
            grouped.setdefault(int(match.group(1)), []).append(key)
    if sorted(grouped) != list(range(len(grouped))):
        raise ValueError(f"group indices in the keys must be 0..G-1, got {sorted(grouped)}")
    return GroupLayout(tuple(shared), tuple(tuple(grouped[g]) for g in range(len(grouped))))


def held_groups(class_groups: Sequence[int], labels: Tensor) -> tuple[int, ...]:
    """The groups with at least one class present in ``labels`` (Fed2, Eq. 6)."""
    present = torch.unique(labels).tolist()
    return tuple(sorted({class_groups[int(c)] for c in present}))


class GroupedConv2d(nn.Module):
    """``G`` conv groups stored as ``groups.{g}`` (an ``nn.Conv2d`` each, for storage and init).

    Parameters
    ----------
    in_channels : int
        Input channels of the whole layer.
    group_width : int
        Output channels of each group.
    num_groups : int
        ``G``.
    kernel_size : int
        Square kernel size (padding keeps the spatial size).
    branching : bool
        Every group reads all input channels (the first grouped layer); otherwise group ``g`` reads only
        input group ``g``.
    """

    def __init__(self, in_channels: int, group_width: int, num_groups: int, kernel_size: int, branching: bool) -> None:
        super().__init__()
        group_in = in_channels if branching else in_channels // num_groups
        self.branching = branching
        self.padding = kernel_size // 2
        self.groups = nn.ModuleList(
            nn.Conv2d(group_in, group_width, kernel_size, padding=self.padding) for _ in range(num_groups)
        )

    def forward(self, x: Tensor) -> Tensor:
        if any(conv._forward_pre_hooks or conv._forward_hooks for conv in self.groups):
            return self.forward_per_group(x)
        weight = torch.cat([conv.weight for conv in self.groups])
        bias = torch.cat([conv.bias for conv in self.groups])
        return F.conv2d(x, weight, bias, padding=self.padding, groups=1 if self.branching else len(self.groups))

    def forward_per_group(self, x: Tensor) -> Tensor:
        """The same function, calling each ``groups.{g}`` conv on its own input: slower, but hooks on a
        group (the analysis tools' activation capture) see exactly that group's input and output.
        :meth:`forward` takes this path only while such a hook is registered."""
        chunks = [x] * len(self.groups) if self.branching else x.chunk(len(self.groups), dim=1)
        return torch.cat([conv(chunk) for conv, chunk in zip(self.groups, chunks, strict=True)], dim=1)


class GroupedNorm(nn.Module):
    """GroupNorm with ``G`` groups whose scale and shift are stored per group (``groups.{g}``)."""

    def __init__(self, group_width: int, num_groups: int) -> None:
        super().__init__()
        self.groups = nn.ModuleList(nn.GroupNorm(1, group_width) for _ in range(num_groups))

    def forward(self, x: Tensor) -> Tensor:
        weight = torch.cat([norm.weight for norm in self.groups])
        bias = torch.cat([norm.bias for norm in self.groups])
        return F.group_norm(x, len(self.groups), weight, bias, self.groups[0].eps)


class GroupedLinear(nn.Module):
    """``G`` linear groups (``groups.{g}``); ``branching`` as in :class:`GroupedConv2d`.

    Input group ``g`` is the ``g``-th contiguous block of features, which is how a
    flattened grouped feature map is laid out (channel-major).
    """

    def __init__(self, in_features: int, out_features: Sequence[int], branching: bool) -> None:
        super().__init__()
        num_groups = len(out_features)
        group_in = in_features if branching else in_features // num_groups
        self.branching = branching
        self.in_features = in_features
        self.groups = nn.ModuleList(nn.Linear(group_in, n) for n in out_features)

    def forward(self, x: Tensor) -> Tensor:
        if self.branching:
            return torch.cat([linear(x) for linear in self.groups], dim=1)
        chunks = x.view(x.shape[0], len(self.groups), -1).unbind(1)
        return torch.cat([linear(chunk) for linear, chunk in zip(self.groups, chunks)], dim=1)


class GroupedHeads(GroupedLinear):
    """The classifier: head ``g`` emits the logits of the classes mapped to ``g``, put back in class order."""

    def __init__(self, in_features: int, class_groups: Sequence[int], branching: bool) -> None:
        num_groups = max(class_groups) + 1
        super().__init__(in_features, [class_groups.count(g) for g in range(num_groups)], branching)
        in_group_order = sorted(range(len(class_groups)), key=lambda c: (class_groups[c], c))
        self.register_buffer("class_order", torch.argsort(torch.tensor(in_group_order)), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).index_select(1, self.class_order)


class PsiNet(ConvStack):
    """A VGG-style conv net in Ψ-Net form (see the module notes); its forward pass is :class:`ConvStack`'s.

    Parameters
    ----------
    input_shape, num_classes, config, hidden, kernel_size, pan
        As :class:`alignfl.models.cnn.PlainConvNet`.
    num_groups : int
        ``G``; 0 means one group per class.
    depth : int
        Number of shared hidden layers (convs counted first, then hidden FCs), in
        ``[0, len(convs) + len(hidden)]``; the classifier is always grouped.
    """

    def __init__(
        self,
        input_shape: InputShape,
        num_classes: int,
        config: Sequence[int | str],
        hidden: tuple[int, ...],
        kernel_size: int,
        pan: PanSettings,
        num_groups: int,
        depth: int,
    ) -> None:
        super().__init__()
        channels, height, width = input_shape
        plan = conv_plan(config)
        layers = len(plan) + len(hidden)
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= layers:
            raise ValueError(
                f"psi-depth must be an int in [0, {layers}] (the hidden layers of this net), got {depth!r}"
            )
        groups = num_classes if num_groups == 0 else num_groups
        self.class_groups = contiguous_class_groups(num_classes, groups)
        self.num_groups, self.depth = groups, depth

        def group_width(index: int, base: int) -> int:
            return base if index < depth else math.ceil(base / groups)

        conv_widths = [group_width(i, w) for i, (w, _) in enumerate(plan)]
        self.convs, self.norms = nn.ModuleList(), nn.ModuleList()
        c_in = channels
        for i, w in enumerate(conv_widths):
            if i < depth:
                self.convs.append(nn.Conv2d(c_in, w, kernel_size, padding=kernel_size // 2))
                self.norms.append(nn.BatchNorm2d(w))
                c_in = w
            else:
                self.convs.append(GroupedConv2d(c_in, w, groups, kernel_size, branching=i == depth))
                self.norms.append(GroupedNorm(w, groups))
                c_in = w * groups
        self.conv_pans = nn.ModuleList(PositionEncoding(self._width(i, w), pan) for i, w in enumerate(conv_widths))
        self.pool_after, self.spatial = pooling_plan([wants for _, wants in plan], height, width)

        self.fcs = nn.ModuleList()
        features = c_in * self.spatial
        fc_widths = []
        for j, n in enumerate(hidden):
            i = len(plan) + j
            w = group_width(i, n)
            fc_widths.append(self._width(i, w))
            if i < depth:
                self.fcs.append(nn.Linear(features, w))
            else:
                self.fcs.append(GroupedLinear(features, [w] * groups, branching=i == depth))
            features = fc_widths[-1]
        self.fc_pans = nn.ModuleList(PositionEncoding(n, pan) for n in fc_widths)
        self.classifier = GroupedHeads(features, self.class_groups, branching=depth == layers)
        self._spec = self._build_spec()

    def _width(self, index: int, group_width: int) -> int:
        """A layer's total number of units."""
        return group_width if index < self.depth else group_width * self.num_groups

    def layout(self) -> GroupLayout:
        """Shared and per-group keys of this model's federated (floating-point) state."""
        return group_layout(k for k, v in self.state_dict().items() if torch.is_floating_point(v))

    def permutation_spec(self) -> PermutationSpec:
        """Shared layers: one group per layer, as the plain nets. Grouped layers: one group per
        (layer, group) — units are permuted only within their group, never across groups."""
        return self._spec

    def _build_spec(self) -> PermutationSpec:
        names = [f"convs.{i}" for i in range(len(self.convs))] + [f"fcs.{i}" for i in range(len(self.fcs))]
        consumers = names[1:] + ["classifier"]
        last_conv = len(self.convs) - 1
        spec: dict[str, tuple[AxisRef, ...]] = {}
        for i, (name, consumer) in enumerate(zip(names, consumers)):
            block = self.spatial if i == last_conv else 1
            norm = f"norms.{i}" if i < len(self.convs) else None
            if i < self.depth:
                branches = [f"{consumer}.groups.{g}" for g in range(self.num_groups)]
                reads = (
                    inputs_of(consumer, block)
                    if i + 1 < self.depth
                    else tuple(ref for branch in branches for ref in inputs_of(branch, block))
                )
                spec[name] = outputs_of(name) + (batchnorm_of(norm) if norm else ()) + reads
            else:
                for g in range(self.num_groups):
                    norm_refs = (AxisRef(f"{norm}.groups.{g}.weight", 0), AxisRef(f"{norm}.groups.{g}.bias", 0))
                    spec[f"{name}.groups.{g}"] = (
                        outputs_of(f"{name}.groups.{g}")
                        + (norm_refs if norm else ())
                        + inputs_of(f"{consumer}.groups.{g}", block)
                    )
        return class_group_spec(spec)


def psi_vgg9(
    input_shape: InputShape, num_classes: int, pan: PanSettings, psi_groups: int, psi_depth: int, width_factor: float
) -> PsiNet:
    """VGG-9 (convs 32, 64, M, 128, 128, M, 256, 256, M; FC 512, 512, each times ``width_factor``) in Ψ-Net form."""
    config, hidden = scale_widths(VGG9_CONFIG, width_factor), scale_widths(VGG9_HIDDEN, width_factor)
    return PsiNet(input_shape, num_classes, config, hidden, 3, pan, psi_groups, psi_depth)


MODELS.register(Model("psi-vgg9", psi_vgg9, PsiOptions))


def psi_vgg11(
    input_shape: InputShape, num_classes: int, pan: PanSettings, psi_groups: int, psi_depth: int, width_factor: float
) -> PsiNet:
    """VGG-11 convs (times ``width_factor``) with a single classifier (heads) in Ψ-Net form."""
    return PsiNet(input_shape, num_classes, scale_widths(VGG11_CONFIG, width_factor), (), 3, pan, psi_groups, psi_depth)


MODELS.register(Model("psi-vgg11", psi_vgg11, PsiOptions))
