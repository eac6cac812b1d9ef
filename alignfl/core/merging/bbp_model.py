"""BBP-MAP (:mod:`alignfl.core.merging.bbp`) over a whole model: each group of its permutation spec matched in turn, the
clients' states scattered onto the global units it opens, and the rest averaged.

A group's unit vectors are read from the client states through the spec
(:func:`match_group`), its atoms become the global entries
(:func:`units_to_entries`), and every client's axes of the group move onto the
global units (:func:`scatter_group`), so that the next group's inputs are in
global indexing; :func:`bbp_matched_average` does this for every group and
averages what no group matches (the output layer, per class with class counts).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from alignfl.core.merging.bbp import BBPSettings, GroupMatch, as_generator, check_weights, match_units
from alignfl.core.merging.layerwise import class_shares
from alignfl.models.permutation import AxisRef, PermutationSpec, unit_view

StateDict = Mapping[str, Tensor]


class BBPResult(NamedTuple):
    """What :func:`bbp_matched_average` returns: the grown global state, each group's width and assignments."""

    state: dict[str, Tensor]
    widths: dict[str, int]
    assignments: dict[str, tuple[Tensor, ...]]


def growth_problem(spec: PermutationSpec) -> str | None:
    """Why BBP-MAP cannot match a model with permutation description ``spec``: it may widen every group, and the
    description keeps one at its width; None when every group may grow."""
    if not spec.fixed:
        return None
    group, reason = next(iter(spec.fixed.items()))
    others = f" and {len(spec.fixed) - 1} more" if len(spec.fixed) > 1 else ""
    return f"BBP-MAP may widen any group, and group {group!r}{others} cannot change width: {reason}"


# --- one group of a permutation spec -----------------------------------------------------------


def aligned_refs(spec: PermutationSpec, group: str, solved: Collection[str]) -> list[AxisRef]:
    """The entries of ``group`` whose other permuted axes all belong to ``solved`` groups (already global)."""
    axes = spec.axes_by_key()
    return [
        ref
        for ref in spec.groups[group]
        if all(name in solved for name, other in axes[ref.key] if other.axis != ref.axis)
    ]


def output_keys(spec: PermutationSpec, state: StateDict) -> set[str]:
    """Floating entries with an axis 0 no group permutes (the classifier): never matched, averaged."""
    touched = {ref.key for refs in spec.groups.values() for ref in refs if ref.axis == 0}
    return {
        key for key, tensor in state.items() if key not in touched and tensor.is_floating_point() and tensor.dim() >= 1
    }


def match_group(
    states: Sequence[StateDict],
    weights: Sequence[float],
    spec: PermutationSpec,
    group: str,
    solved: Collection[str],
    settings: BBPSettings,
    generator: torch.Generator | int = 0,
    *,
    head: Collection[str],
) -> GroupMatch:
    """BBP-MAP of one group across K client states whose ``solved`` groups are already in global indexing.

    A unit's vector concatenates its row of :func:`~alignfl.models.permutation.unit_view`
    for every entry of :func:`aligned_refs`: incoming weights (their inputs
    already scattered onto the previous groups' global units), bias,
    normalisation entries, and weights into a layer that is never permuted.
    The output layer's entries ``head`` (:func:`alignfl.models.protocol.head_of`) are
    among them for the last hidden group; they are left out unless
    ``settings.include_classifier``, as FedMA does.
    """
    if group not in spec.groups or set(solved) - set(spec.groups):
        raise ValueError(f"group {group!r} and solved groups {sorted(solved)} must be among {list(spec.groups)}")
    if group in spec.fixed:
        raise ValueError(f"group {group!r} cannot change width ({spec.fixed[group]}), and BBP-MAP may widen it")
    refs = [ref for ref in aligned_refs(spec, group, solved) if settings.include_classifier or ref.key not in head]
    if not refs:
        raise ValueError(
            f"group {group!r} has no entry aligned on its other axes outside the output layer "
            f"{sorted(head)}; solve {sorted(solved)} first"
        )
    views = [[unit_view(state[ref.key], ref) for ref in refs] for state in states]
    match = match_units([torch.cat(parts, dim=1) for parts in views], weights, settings, generator)
    return GroupMatch(match.assignments, match.units, tuple(refs), tuple(view.shape[1] for view in views[0]))


def units_to_entries(match: GroupMatch, spec: PermutationSpec, state: StateDict) -> dict[str, Tensor]:
    """The global entries ``match``'s units define, at the group's global width, typed like ``state``'s.

    Output entries (:func:`output_keys`) are left out: they are averaged, not matched.
    """
    outputs = output_keys(spec, state)
    entries: dict[str, Tensor] = {}
    for ref, columns in zip(match.refs, torch.split(match.units, list(match.features), dim=1)):
        if ref.key in outputs:
            continue
        template = state[ref.key]
        shape = template.shape[: ref.axis] + (match.width * ref.block,) + template.shape[ref.axis + 1 :]
        layout = (match.width,) + template.shape[: ref.axis] + (ref.block,) + template.shape[ref.axis + 1 :]
        entries[ref.key] = columns.reshape(layout).movedim(0, ref.axis).reshape(shape).to(template.dtype)
    return entries


def scatter_units(tensor: Tensor, ref: AxisRef, assignment: Tensor, width: int) -> Tensor:
    """``tensor`` with the units of ``ref`` moved to their global positions among ``width`` (zeros elsewhere)."""
    before, after = tensor.shape[: ref.axis], tensor.shape[ref.axis + 1 :]
    split = tensor.reshape(before + (tensor.shape[ref.axis] // ref.block, ref.block) + after)
    grown = split.new_zeros(before + (width, ref.block) + after)
    grown.index_copy_(ref.axis, assignment.to(tensor.device), split)
    return grown.reshape(before + (width * ref.block,) + after)


def patch_clients(
    states: Sequence[StateDict], spec: PermutationSpec, group: str, match: GroupMatch
) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """The global entries of ``match`` and every client's state with them in place and its other entries of
    ``group`` (the next layer's inputs) moved onto the global units, zeros for the units it lacks: each client's
    model at the grown width, as FedMA's next stage trains it."""
    entries = units_to_entries(match, spec, states[0])
    clients = [
        {
            **scatter_group({k: v for k, v in state.items() if k not in entries}, spec, group, assignment, match.width),
            **entries,
        }
        for state, assignment in zip(states, match.assignments)
    ]
    return entries, clients


def scatter_group(
    state: StateDict, spec: PermutationSpec, group: str, assignment: Tensor, width: int
) -> dict[str, Tensor]:
    """A client's state with every axis of ``group`` moved onto the global units (PFNM's weight patching).

    Entries of the group that ``state`` lacks are skipped, so a caller can drop the ones it is done with.
    """
    scattered = dict(state)
    for ref in spec.groups[group]:
        if ref.key in scattered:
            scattered[ref.key] = scatter_units(scattered[ref.key], ref, assignment, width)
    return scattered


# --- the whole model --------------------------------------------------------------------------


def bbp_matched_average(
    states: Sequence[StateDict],
    weights: Sequence[float],
    spec: PermutationSpec,
    settings: BBPSettings | None = None,
    generator: torch.Generator | int = 0,
    class_counts: Tensor | Sequence[Sequence[float]] | None = None,
    *,
    head: Collection[str],
) -> BBPResult:
    """Match every group of ``spec`` by BBP-MAP, in spec order, and build the grown global state.

    ``head`` is the output layer's keys (:func:`alignfl.models.protocol.head_of`); see :func:`match_group`.

    After a group is matched, its global entries come from the atoms and every
    client's axes of the group are scattered onto the global units, so the next
    group's inputs are in global indexing (zeros where a client has no unit).
    Output entries (:func:`output_keys`) and entries no group touches are
    averaged over the scattered clients with ``weights``; with
    ``class_counts`` (``K x C``) the output entries with ``C`` rows are
    averaged row by row with each class's counts, as FedMA does (a class no
    client holds falls back to ``weights``). Integer entries come from the
    first client.
    """
    settings = settings or BBPSettings()
    _check_states(states, weights, spec)
    share = torch.tensor([float(w) for w in weights], dtype=torch.float64)
    share = share / share.sum()
    mixes = {} if class_counts is None else _output_mixes(spec, states[0], share, class_counts)
    rng = as_generator(generator)
    clients = [dict(state) for state in states]
    merged: dict[str, Tensor] = {}
    widths: dict[str, int] = {}
    assignments: dict[str, tuple[Tensor, ...]] = {}
    for group in spec.groups:
        match = match_group(clients, weights, spec, group, widths, settings, rng, head=head)
        merged.update(units_to_entries(match, spec, clients[0]))
        clients = [
            scatter_group(
                {key: value for key, value in client.items() if key not in merged}, spec, group, assignment, match.width
            )
            for client, assignment in zip(clients, match.assignments)
        ]
        widths[group], assignments[group] = match.width, match.assignments
    merged.update(_averaged(clients, share, mixes))
    return BBPResult({key: merged[key] for key in states[0]}, widths, assignments)


def _output_mixes(
    spec: PermutationSpec, state: StateDict, share: Tensor, class_counts: Tensor | Sequence[Sequence[float]]
) -> dict[str, Tensor]:
    """``K x C`` averaging weights for each output entry with one row per class: each class's share of the
    clients' counts (the clients' ``share`` for a class nobody holds)."""
    counts = torch.as_tensor(class_counts, dtype=torch.float64)
    if (
        counts.dim() != 2
        or counts.shape[0] != share.numel()
        or not bool(torch.isfinite(counts).all())
        or bool((counts < 0).any())
    ):
        raise ValueError(
            f"class_counts must be a K x C matrix of finite counts >= 0 with K = {share.numel()}, "
            f"got shape {tuple(counts.shape)}"
        )
    outputs = output_keys(spec, state)
    keys = [key for key in outputs if state[key].shape[0] == counts.shape[1]]
    if not keys:
        raise ValueError(
            f"class_counts has {counts.shape[1]} classes, but no output entry ({sorted(outputs)}) has that many rows"
        )
    return dict.fromkeys(keys, class_shares(counts, share))


def _averaged(clients: Sequence[StateDict], share: Tensor, mixes: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every entry of the clients averaged with ``share`` (or its row-wise weights in ``mixes``); integer
    entries are taken from the first client."""
    averaged: dict[str, Tensor] = {}
    for key, first in clients[0].items():
        if not first.is_floating_point():
            averaged[key] = first.clone()
            continue
        stacked = torch.stack([client[key].double() for client in clients])
        mix = mixes.get(key, share)
        averaged[key] = (mix.reshape(mix.shape + (1,) * (stacked.dim() - mix.dim())) * stacked).sum(0).to(first.dtype)
    return averaged


def _check_states(states: Sequence[StateDict], weights: Sequence[float], spec: PermutationSpec) -> None:
    """Raise ValueError unless all states have the first one's keys and shapes and fit ``spec``."""
    check_weights(len(states), weights)
    first = states[0]
    for index, state in enumerate(states):
        if set(state) != set(first):
            raise ValueError(
                f"client {index}'s state has other keys than client 0's: {sorted(set(state) ^ set(first))[:5]}"
            )
        odd = [key for key, tensor in first.items() if state[key].shape != tensor.shape]
        if odd:
            raise ValueError(f"client {index}'s entries {odd[:5]} have other shapes than client 0's")
    spec.group_sizes(first)
