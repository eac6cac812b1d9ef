"""One description of a model's permutation symmetry, and the operations that read it.

A model's :class:`PermutationSpec` names *groups* of hidden units that can be
reordered together without changing the network's function (PANs off). Each
group lists every state-dict entry it acts on as an :class:`AxisRef`:
``(key, axis, block)``.

Conventions
-----------
* A permutation is a 1-D long tensor ``perm`` of length ``J`` (the group size):
  new unit ``i`` is old unit ``perm[i]`` (``new = old.index_select(axis, perm)``).
* ``block`` handles flattening. Along ``axis`` each unit owns ``block``
  consecutive indices, so the axis has length ``J * block``. It is 1 everywhere
  except the input axis of the first linear layer after a flattened ``C x H x W``
  feature map, where channel ``c`` owns columns ``c*H*W ... (c+1)*H*W - 1``
  (``block = H*W``); permuting channel ``c`` moves that whole block of columns.
* Groups cover hidden units only: never the input axis of the first layer nor
  the output axis of the classifier.
* Groups are ordered from the input side to the output side, by where the
  group's units are first produced on the forward path (for ResNet a residual
  stream comes right after the block that creates it). Matching engines iterate
  ``spec.groups`` in this order.
* BatchNorm ``weight``, ``bias``, ``running_mean`` and ``running_var`` move with
  their channel; ``num_batches_tracked`` and PAN encodings (not in the state
  dict) never move.
* A group's width may change (a matching that opens new units, FedMA's BBP-MAP,
  widens it) unless the spec lists it in ``fixed`` with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor


class AxisRef(NamedTuple):
    """One axis of one state-dict entry acted on by a permutation group.

    Parameters
    ----------
    key : str
        The state-dict key, e.g. ``"convs.0.weight"``.
    axis : int
        The axis indexed by the group's units (0: outputs, 1: inputs of a weight).
    block : int
        How many consecutive indices along ``axis`` belong to one unit (see the
        module notes on flattening); 1 for ordinary axes.
    """

    key: str
    axis: int
    block: int = 1


@dataclass(frozen=True)
class PermutationSpec:
    """Groups of hidden units that may be permuted together, in input-to-output order.

    Parameters
    ----------
    groups : Mapping[str, Iterable[AxisRef | tuple]]
        Group name -> the axes it acts on. Plain ``(key, axis)`` or
        ``(key, axis, block)`` tuples are accepted and converted to
        :class:`AxisRef`. Stored as a read-only mapping of tuples.
    fixed : Mapping[str, str], optional
        Group name -> why that group's width cannot change (the model's forward pass ties it to other
        widths). Empty: every group may grow.
    """

    groups: Mapping[str, tuple[AxisRef, ...]]
    fixed: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        groups = {name: tuple(AxisRef(*ref) for ref in refs) for name, refs in self.groups.items()}
        seen: dict[tuple[str, int], str] = {}
        for name, refs in groups.items():
            if not refs:
                raise ValueError(f"permutation group {name!r} acts on no axis")
            for ref in refs:
                if ref.block < 1:
                    raise ValueError(f"group {name!r}: block of {ref.key!r} must be >= 1, got {ref.block}")
                owner = seen.setdefault((ref.key, ref.axis), name)
                if owner != name:
                    raise ValueError(f"axis {ref.axis} of {ref.key!r} is claimed by groups {owner!r} and {name!r}")
        unknown = sorted(set(self.fixed) - set(groups))
        if unknown:
            raise ValueError(f"fixed-width groups {unknown} are not among the groups {list(groups)}")
        object.__setattr__(self, "groups", MappingProxyType(groups))
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))

    def __reduce__(self) -> tuple[type, tuple[dict[str, tuple[AxisRef, ...]], dict[str, str]]]:
        """Rebuild from plain dicts: a read-only mapping cannot be pickled or deep-copied as is."""
        return PermutationSpec, (dict(self.groups), dict(self.fixed))

    def group_sizes(self, state: Mapping[str, Tensor]) -> dict[str, int]:
        """Number of units ``J`` of every group, checked to agree across all its axes."""
        sizes: dict[str, int] = {}
        for name, refs in self.groups.items():
            lengths = {ref: _axis_length(state, ref) for ref in refs}
            units = {length // ref.block for ref, length in lengths.items()}
            ragged = [ref.key for ref, length in lengths.items() if length % ref.block]
            if len(units) != 1 or ragged:
                raise ValueError(f"group {name!r} has inconsistent sizes: { {r.key: n for r, n in lengths.items()} }")
            sizes[name] = units.pop()
        return sizes

    def axes_by_key(self) -> dict[str, list[tuple[str, AxisRef]]]:
        """State-dict key -> ``[(group name, AxisRef), ...]`` for every key the spec touches."""
        by_key: dict[str, list[tuple[str, AxisRef]]] = {}
        for name, refs in self.groups.items():
            for ref in refs:
                by_key.setdefault(ref.key, []).append((name, ref))
        return by_key


@runtime_checkable
class Permutable(Protocol):
    """A model that describes its own permutation symmetry."""

    def permutation_spec(self) -> PermutationSpec: ...


def _axis_length(state: Mapping[str, Tensor], ref: AxisRef) -> int:
    if ref.key not in state:
        raise KeyError(f"permutation spec refers to {ref.key!r}, which is not in the state dict")
    return state[ref.key].shape[ref.axis]


def _split_blocks(tensor: Tensor, ref: AxisRef) -> Tensor:
    """View ``tensor`` with ``ref.axis`` split into ``(units, block)``."""
    shape = tensor.shape
    units = shape[ref.axis] // ref.block
    return tensor.reshape(shape[: ref.axis] + (units, ref.block) + shape[ref.axis + 1 :])


def unit_view(tensor: Tensor, ref: AxisRef) -> Tensor:
    """``tensor`` as a ``(J, -1)`` matrix with one row per unit of ``ref``.

    This is what cost matrices for matching are built from: row ``j`` holds every
    number of this entry that moves with unit ``j`` (a whole ``H*W`` column block
    for a flattened channel).
    """
    return _split_blocks(tensor, ref).movedim(ref.axis, 0).reshape(tensor.shape[ref.axis] // ref.block, -1)


def permute_axis(tensor: Tensor, ref: AxisRef, perm: Tensor) -> Tensor:
    """A new tensor with the units of ``ref`` reordered: new unit ``i`` is old unit ``perm[i]``."""
    moved = _split_blocks(tensor, ref).index_select(ref.axis, perm.to(device=tensor.device, dtype=torch.long))
    return moved.reshape(tensor.shape)


def permute_state(spec: PermutationSpec, state: Mapping[str, Tensor], perms: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Apply ``perms`` (group name -> permutation) to a state dict.

    Parameters
    ----------
    spec : PermutationSpec
        The model's permutation description.
    state : mapping of str to Tensor
        A state dict of that model.
    perms : mapping of str to Tensor
        Group name -> permutation (new unit ``i`` is old unit ``perm[i]``). Groups missing here are left as
        they are, so a matcher can fix one group at a time.

    Returns
    -------
    dict of str to Tensor
        A new dict of new tensors; keys the spec does not touch are cloned unchanged.

    Raises
    ------
    ValueError
        For a group the spec lacks, or a permutation of the wrong size.
    """
    unknown = sorted(set(perms) - set(spec.groups))
    if unknown:
        raise ValueError(f"unknown permutation groups {unknown}; allowed: {list(spec.groups)}")
    sizes = spec.group_sizes(state)
    for name, perm in perms.items():
        _check_permutation(name, perm, sizes[name])
    axes = spec.axes_by_key()
    permuted: dict[str, Tensor] = {}
    for key, tensor in state.items():
        out = tensor.clone()
        for name, ref in axes.get(key, ()):
            if name in perms:
                out = permute_axis(out, ref, perms[name])
        permuted[key] = out
    return permuted


def _check_permutation(name: str, perm: Tensor, size: int) -> None:
    expected = torch.arange(size, device=perm.device)
    if perm.dim() != 1 or perm.numel() != size or not torch.equal(perm.sort().values.long(), expected):
        raise ValueError(f"permutation for group {name!r} must reorder 0..{size - 1}, got shape {tuple(perm.shape)}")


def random_permutations(
    spec: PermutationSpec, state: Mapping[str, Tensor], generator: torch.Generator
) -> dict[str, Tensor]:
    """A uniformly random permutation for every group (reproducible through ``generator``)."""
    return {name: torch.randperm(n, generator=generator) for name, n in spec.group_sizes(state).items()}


def identity_permutations(spec: PermutationSpec, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The permutation that changes nothing, for every group."""
    return {name: torch.arange(n) for name, n in spec.group_sizes(state).items()}


def invert_permutations(perms: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Inverses: ``permute_state(spec, permute_state(spec, s, p), invert_permutations(p))`` is ``s``."""
    return {name: torch.argsort(perm) for name, perm in perms.items()}


def outputs_of(prefix: str, bias: bool = True) -> tuple[AxisRef, ...]:
    """The output-unit axes of a linear/conv layer: weight axis 0 and, if present, its bias."""
    refs = (AxisRef(f"{prefix}.weight", 0),)
    return refs + (AxisRef(f"{prefix}.bias", 0),) if bias else refs


def inputs_of(prefix: str, block: int = 1) -> tuple[AxisRef, ...]:
    """The input axis of a linear/conv layer's weight (``block = H*W`` after a flatten)."""
    return (AxisRef(f"{prefix}.weight", 1, block),)


def batchnorm_of(prefix: str) -> tuple[AxisRef, ...]:
    """Every per-channel entry of a BatchNorm layer (``num_batches_tracked`` excluded)."""
    names = ("weight", "bias", "running_mean", "running_var")
    return tuple(AxisRef(f"{prefix}.{name}", 0) for name in names)
