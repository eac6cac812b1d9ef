"""Hidden-unit activations of any model, found through its permutation spec.

Where a group's activations are read
------------------------------------
A group's units are *produced* by a linear/conv layer, but the PAN encoding and the
non-linearity that turn them into the neuron's output come after that module (the PAN
in its own module, the ReLU/GELU functionally), so a hook on the producer would see
pre-PAN, pre-activation values. Every group also lists the layer that *reads* its
units (an :class:`~alignfl.models.AxisRef` on axis 1 of a ``.weight``); that consumer's input
is exactly the neurons' output: after the PAN and the non-linearity (and after any
max-pool or flatten in between). So a forward pre-hook on the group's first consumer,
in spec order, captures the groups of every model with no per-model code:

* MLP / VGG / 2CNN: the next layer's input (``hidden.1`` reads ``hidden.0``'s units);
* ResNet ``blocks.i.conv1``: ``conv2``'s input, ``relu(pan1(bn1(conv1 x)))``;
* ResNet ``stream.k``: the input of the first block that reads the stream, i.e. the
  stream right after the stem (``stream.0``) or after the block whose shortcut starts
  it; later positions of the same stream are not included;
* transformer ``mlp``: ``fc2``'s input (after PAN and GELU); ``attn.v``: the attention
  output that ``attn.out`` reads; ``stream``: the LayerNorm'd stream that ``query`` reads.

A group that no linear/conv layer reads (attention's ``attn.qk``: q and k meet in a
matmul) is read at the **output** of its first producer (the axis-0 ``.weight``
entry), e.g. the queries.

Ψ-Net's grouped layers store one module per group (``convs.3.groups.7``); a grouped conv
calls them one by one while a hook sits on one of them (otherwise it runs them as a
single grouped convolution), so its groups are captured like any other layer. A layer
whose module never runs still cannot be hooked; reading such a group raises
:class:`UnitsNotCaptured` naming it.

The feature axis is the layer's: the last axis for ``nn.Linear`` (also over tokens),
axis 1 for convolutions. ``(N, J * block, ...)`` is then viewed as ``(N, J, S)``: one
row per unit holding its value at every spatial position or token (``block = H*W``
after a flatten).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, nn

from alignfl.fl_app.analysis.common import AnalysisError
from alignfl.models import AxisRef, Permutable, PermutationSpec


class UnitsNotCaptured(AnalysisError):
    """A group's layer did not run as a module, so its activations cannot be hooked."""


@dataclass(frozen=True)
class UnitSite:
    """Where a group's activations are read: the ``input`` or ``output`` of ``module``."""

    module: str
    side: str
    block: int


def unit_sites(spec: PermutationSpec) -> dict[str, UnitSite]:
    """Group name -> where its activations are read (see the module notes)."""
    sites: dict[str, UnitSite] = {}
    for name, refs in spec.groups.items():
        weights = [ref for ref in refs if ref.key.endswith(".weight")]
        consumers = [ref for ref in weights if ref.axis == 1]
        producers = [ref for ref in weights if ref.axis == 0]
        if consumers:
            sites[name] = UnitSite(_module_name(consumers[0]), "input", consumers[0].block)
        elif producers:
            sites[name] = UnitSite(_module_name(producers[0]), "output", producers[0].block)
        else:
            raise ValueError(
                f"group {name!r} has no layer that produces or reads it (no '.weight' entry); "
                f"cannot locate its activations"
            )
    return sites


def _module_name(ref: AxisRef) -> str:
    return ref.key.rsplit(".", 1)[0]


def spec_of(model: nn.Module) -> PermutationSpec:
    if not isinstance(model, Permutable):
        raise TypeError(f"{type(model).__name__} has no permutation_spec(); analysis tools need one")
    return model.permutation_spec()


def _feature_axis(module: nn.Module, where: str) -> int:
    """Which axis of a layer's input/output holds its features."""
    if isinstance(module, nn.Linear):
        return -1
    if isinstance(module, nn.modules.conv._ConvNd):
        return 1
    raise TypeError(f"'{where}' is a {type(module).__name__}; unit activations are read at linear or conv layers")


class UnitCapture:
    """The activations seen by the last forward pass, per group.

    ``capture[group]`` is the ``(N, J, S)`` view; ``capture.raw[group]`` is the tensor
    the layer received or returned, which is the one to differentiate with respect to
    (the view is made afterwards and is not part of the forward graph).
    """

    def __init__(self, sizes: Mapping[str, int], sites: Mapping[str, UnitSite], axes: Mapping[str, int]) -> None:
        self.sizes = dict(sizes)
        self.sites = dict(sites)
        self.axes = dict(axes)
        self.raw: dict[str, Tensor] = {}

    def __getitem__(self, group: str) -> Tensor:
        return self.as_units(group, self.raw_of(group))

    def raw_of(self, group: str) -> Tensor:
        """The raw tensor of ``group``, or a clear error when its layer never ran as a module."""
        if group not in self.raw:
            raise UnitsNotCaptured(
                f"activations of group {group!r} were not captured: its layer '{self.sites[group].module}' "
                f"did not run as a module in the forward pass (e.g. a parent that calls its weights "
                f"functionally, as Ψ-Net's grouped layers do), so no hook can see them"
            )
        return self.raw[group]

    def as_units(self, group: str, tensor: Tensor) -> Tensor:
        """``tensor`` (shaped like the group's raw activations, e.g. its gradient) as ``(N, J, S)``."""
        return tensor.movedim(self.axes[group], 1).reshape(tensor.shape[0], self.sizes[group], -1)


@contextmanager
def capture_units(model: nn.Module) -> Iterator[UnitCapture]:
    """While active, every forward pass of ``model`` records each group's activations.

    The tensors stay in the autograd graph when the forward pass builds one (class
    preference vectors need gradients with respect to them).
    """
    spec = spec_of(model)
    sites = unit_sites(spec)
    modules = {group: model.get_submodule(site.module) for group, site in sites.items()}
    axes = {group: _feature_axis(modules[group], site.module) for group, site in sites.items()}
    capture = UnitCapture(spec.group_sizes(model.state_dict()), sites, axes)
    handles = []
    for group, site in sites.items():
        record = _recorder(capture, group, site)
        if site.side == "input":
            handles.append(modules[group].register_forward_pre_hook(lambda _m, args, record=record: record(args[0])))
        else:
            handles.append(modules[group].register_forward_hook(lambda _m, _args, out, record=record: record(out)))
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


def _recorder(capture: UnitCapture, group: str, site: UnitSite):
    expected = capture.sizes[group] * site.block

    def record(features: Tensor) -> None:
        found = features.shape[capture.axes[group]]
        if found != expected:
            raise ValueError(
                f"group {group!r}: {site.side} of '{site.module}' has {found} features, "
                f"expected {capture.sizes[group]} units x block {site.block}"
            )
        capture.raw[group] = features

    return record


def group_sizes(model: nn.Module) -> Mapping[str, int]:
    """Units per group, in spec order."""
    return spec_of(model).group_sizes(model.state_dict())
