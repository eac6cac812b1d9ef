"""Align one model's hidden units onto another's, and average models after aligning them.

Two networks that compute the same function may store their hidden units in a
different order; averaging them coordinate-wise then mixes unrelated units.
This module finds, for every permutation group of a model's
:class:`~models.permutation.PermutationSpec`, the reordering of the second
model's units that best lines them up with the first's, solving one linear
assignment problem per group with :func:`scipy.optimize.linear_sum_assignment`.

Everything reads the spec and nothing else: a shared permutation (a ResNet
residual stream with its BatchNorm entries, a transformer's residual stream with
its embedding and LayerNorms, q and k of an attention head) is one group that
lists all of its axes, so its cost simply sums over all of them. A unit's row
comes from :func:`~models.permutation.unit_view`, so a flattened channel brings
its whole block of ``H*W`` columns. State-dict keys that no group touches are
never changed; PAN encodings are not in state dicts at all.

Costs (registered by name, see :func:`list_costs`):

``weight``
    Git Re-Basin's weight matching (Ainsworth et al., 2023). For one group,
    maximise ``sum <W_ref, P W_other>`` over every entry touching the group, on
    its incoming *and* outgoing axes, with the other groups' current
    permutations applied to the entries' other axes. Groups are visited in a
    random order (coordinate descent) until a full sweep changes nothing, or
    :data:`MAX_SWEEPS` sweeps. Unlike Git Re-Basin, the descent starts from a
    sequential pass (as ``l1``, with inner products) rather than the identity;
    see :func:`weight_matching` for why.
``l1``
    Simple-FedMA (seed paper 002): minimise the sum of absolute weight
    differences. Groups are solved once, in spec order (input side first). A
    group's cost uses every entry whose other permuted axes all belong to groups
    already solved, with those permutations applied: the incoming weights, bias
    and normalisation entries, plus outgoing weights into a layer whose outputs
    are never permuted (the classifier) -- ALGORITHMS.md §2's "outgoing weights
    where the next layer's permutation is already fixed". Weights into a later,
    unsolved group are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from models.permutation import AxisRef, PermutationSpec, permute_axis, permute_state, unit_view

StateDict = Mapping[str, Tensor]
Permutations = dict[str, Tensor]
Matcher = Callable[[StateDict, StateDict, PermutationSpec, torch.Generator], Permutations]
Score = Callable[[Tensor, Tensor], Tensor]

MAX_SWEEPS = 100
"""Cap on coordinate-descent sweeps of the ``weight`` cost (a sweep visits every group once)."""

# A new assignment replaces the current one only if it scores better by more than float noise,
# so ties (e.g. two identical units) never make the descent cycle or reorder units for nothing.
_IMPROVEMENT_RTOL = 1e-9


@dataclass(frozen=True)
class CostEntry:
    """One registered cost: how all groups of a model are matched, and its unit-to-unit score.

    ``score(reference_rows, other_rows)`` is the ``J x J`` matrix to maximise for
    one group; the layer-wise FedMA schedule solves one group at a time with it.
    """

    name: str
    match: Matcher
    score: Score
    summary: str


_COSTS: dict[str, CostEntry] = {}


def register_cost(name: str, score: Score, summary: str) -> Callable[[Matcher], Matcher]:
    """Decorator registering ``match(reference, other, spec, generator) -> permutations`` under ``name``."""

    def decorate(match: Matcher) -> Matcher:
        if name in _COSTS:
            raise ValueError(f"alignment cost {name!r} is already registered")
        _COSTS[name] = CostEntry(name, match, score, summary)
        return match

    return decorate


def list_costs() -> list[str]:
    """Names of the registered alignment costs, sorted."""
    return sorted(_COSTS)


def get_cost(name: str) -> CostEntry:
    """The registered cost called ``name``."""
    if name not in _COSTS:
        raise ValueError(f"unknown alignment cost {name!r}; allowed: {list_costs()}")
    return _COSTS[name]


# --- building blocks ------------------------------------------------------------------


def check_compatible(reference: StateDict, other: StateDict, spec: PermutationSpec) -> None:
    """Raise ValueError unless both states have the same keys and shapes and fit ``spec``."""
    missing, extra = sorted(set(reference) - set(other)), sorted(set(other) - set(reference))
    if missing or extra:
        raise ValueError(f"state dicts differ in keys: missing {missing[:5]}, unexpected {extra[:5]}")
    for key, tensor in reference.items():
        if other[key].shape != tensor.shape:
            raise ValueError(f"state entry {key!r} has shape {tuple(other[key].shape)}, "
                             f"but {tuple(tensor.shape)} in the reference")
    spec.group_sizes(reference)


def unit_rows(
    state: StateDict,
    refs: Iterable[AxisRef],
    perms: Mapping[str, Tensor],
    axes_by_key: Mapping[str, list[tuple[str, AxisRef]]],
) -> list[Tensor]:
    """For every entry in ``refs`` (all acting on one group), a float32 ``J x F`` matrix, one row per unit.

    Before an entry is viewed along its own axis, the permutations in ``perms``
    are applied to its *other* permuted axes, so rows are compared in the
    reference's order of the neighbouring groups. The blocks are kept apart
    (not concatenated): both scores are sums over features, so they are summed
    block by block without copying every row into one matrix.
    """
    blocks = []
    for ref in refs:
        tensor = state[ref.key]
        for name, other in axes_by_key[ref.key]:
            if other.axis != ref.axis and name in perms:
                tensor = permute_axis(tensor, other, perms[name])
        blocks.append(unit_view(tensor, ref).float())
    return blocks


def group_score(score: Score, reference_rows: list[Tensor], other_rows: list[Tensor]) -> Tensor:
    """``score`` summed over the entries of a group (both scores add up over feature blocks)."""
    return sum(score(a, b) for a, b in zip(reference_rows, other_rows))


def best_assignment(score: Tensor, current: Tensor) -> Tensor:
    """The permutation maximising ``sum_i score[i, perm[i]]``, or ``current`` unless strictly better.

    ``score[i, j]`` rates putting the other model's unit ``j`` at the
    reference's position ``i``; the result follows the spec's convention (new
    unit ``i`` is old unit ``perm[i]``).
    """
    matrix = score.detach().double().cpu().numpy()
    rows, cols = linear_sum_assignment(matrix, maximize=True)
    kept = matrix[rows, current.cpu().numpy()].sum()
    gain = matrix[rows, cols].sum() - kept
    if gain > _IMPROVEMENT_RTOL * max(abs(kept), 1.0):
        return torch.from_numpy(cols).long()
    return current


# --- costs ----------------------------------------------------------------------------


def solve_group(
    reference: StateDict, other: StateDict, spec: PermutationSpec, group: str, solved: Mapping[str, Tensor],
    score: Score,
) -> Tensor:
    """The permutation of ``group`` given the groups in ``solved`` (name -> their permutation).

    The rows use :func:`solved_refs`: entries whose other permuted axes all
    belong to solved groups, with those permutations applied. The identity
    wins ties, and is the answer when no such entry exists (no evidence).
    """
    identity = torch.arange(spec.group_sizes(reference)[group])
    refs = solved_refs(spec, group, solved)
    if not refs:
        return identity
    axes = spec.axes_by_key()
    rows = unit_rows(reference, refs, {}, axes), unit_rows(other, refs, solved, axes)
    return best_assignment(group_score(score, *rows), identity)


def sequential_matching(reference: StateDict, other: StateDict, spec: PermutationSpec, score: Score) -> Permutations:
    """Solve each group once, in spec order (input side first), from the entries already aligned."""
    perms: Permutations = {}
    for name in spec.groups:
        perms[name] = solve_group(reference, other, spec, name, perms, score)
    return perms


def solved_refs(spec: PermutationSpec, group: str, solved: Iterable[str]) -> list[AxisRef]:
    """The entries of ``group`` whose other permuted axes all belong to ``solved`` groups."""
    done, axes = set(solved), spec.axes_by_key()
    return [ref for ref in spec.groups[group]
            if all(name in done for name, other in axes[ref.key] if other.axis != ref.axis)]


def inner_products(reference_rows: Tensor, other_rows: Tensor) -> Tensor:
    """``<ref unit i, other unit j>``: maximising their sum is minimising the squared L2 distance."""
    return reference_rows @ other_rows.T


def negative_l1(reference_rows: Tensor, other_rows: Tensor) -> Tensor:
    """``-sum |ref unit i - other unit j|``, Simple-FedMA's cost as a score to maximise."""
    return -torch.cdist(reference_rows, other_rows, p=1)


@register_cost("weight", inner_products, "Git Re-Basin weight matching: coordinate descent on sum <W_ref, P W_other>")
def weight_matching(
    reference: StateDict, other: StateDict, spec: PermutationSpec, generator: torch.Generator
) -> Permutations:
    """Coordinate descent over all groups, in random order, until a sweep changes nothing.

    Starts from :func:`sequential_matching` with inner products instead of the
    identity that Git Re-Basin starts from: from the identity, a pair of
    neighbouring groups can lock each other into a wrong order (twocnn's last
    conv and first FC share a large weight matrix whose two permutations are
    each the other's best response), so even an exactly permuted copy would not
    be recovered. The descent only accepts strict improvements, so it never
    leaves an exact match.
    """
    axes = spec.axes_by_key()
    perms = sequential_matching(reference, other, spec, inner_products)
    targets = {name: unit_rows(reference, refs, {}, axes) for name, refs in spec.groups.items()}
    names = list(spec.groups)
    for _ in range(MAX_SWEEPS):
        changed = False
        for index in torch.randperm(len(names), generator=generator).tolist():
            name = names[index]
            rows = unit_rows(other, spec.groups[name], perms, axes)
            perm = best_assignment(group_score(inner_products, targets[name], rows), perms[name])
            if perm is not perms[name]:
                perms[name], changed = perm, True
        if not changed:
            break
    return perms


@register_cost("l1", negative_l1, "Simple-FedMA: sum of absolute differences, groups solved in order from the input")
def l1_matching(
    reference: StateDict, other: StateDict, spec: PermutationSpec, generator: torch.Generator
) -> Permutations:
    """One pass from the input side (``generator`` is unused: the order is fixed)."""
    return sequential_matching(reference, other, spec, negative_l1)


# --- public API -----------------------------------------------------------------------


def find_permutations(
    reference: StateDict,
    other: StateDict,
    spec: PermutationSpec,
    cost: str = "weight",
    generator: torch.Generator | None = None,
) -> Permutations:
    """Group name -> permutation that aligns ``other`` onto ``reference``.

    Apply the result with ``permute_state(spec, other, perms)``. ``generator``
    drives the random visiting order of the ``weight`` cost (default: seed 0,
    so a call without one is reproducible).
    """
    entry = get_cost(cost)
    check_compatible(reference, other, spec)
    return entry.match(reference, other, spec, generator or torch.Generator().manual_seed(0))


def align(
    reference: StateDict,
    other: StateDict,
    spec: PermutationSpec,
    cost: str = "weight",
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """``other`` with its hidden units reordered to line up with ``reference`` (a new state dict)."""
    return permute_state(spec, other, find_permutations(reference, other, spec, cost, generator))


def weighted_average(states: Sequence[StateDict], weights: Sequence[float]) -> dict[str, Tensor]:
    """Coordinate-wise mean of floating-point entries weighted by ``weights`` (e.g. example counts).

    Integer entries (BatchNorm's ``num_batches_tracked``) cannot be averaged and
    are taken from the first state.
    """
    if not states or len(states) != len(weights):
        raise ValueError(f"need one weight per state and at least one state, got {len(states)} states "
                         f"and {len(weights)} weights")
    if any(not w > 0 for w in weights):
        raise ValueError(f"weights must be positive, got {list(weights)}")
    total = float(sum(weights))
    averaged: dict[str, Tensor] = {}
    for key, first in states[0].items():
        if torch.is_floating_point(first):
            averaged[key] = sum(state[key] * (float(w) / total) for state, w in zip(states, weights))
        else:
            averaged[key] = first.clone()
    return averaged


def matched_average(
    reference: StateDict,
    states: Sequence[StateDict],
    weights: Sequence[float],
    spec: PermutationSpec,
    cost: str = "weight",
    iterations: int = 1,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """Align every state onto ``reference``, then average them weighted by ``weights``.

    With ``iterations > 1`` the states are aligned again onto the matched mean
    of the previous iteration, which moves the target from the reference to
    the clients' consensus (the reference only fixes the unit order at first).
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    generator = generator or torch.Generator().manual_seed(0)
    target: StateDict = reference
    for _ in range(iterations):
        target = weighted_average([align(target, state, spec, cost, generator) for state in states], weights)
    return dict(target)
