"""Align one model's hidden units onto another's, and average models after aligning them.

Two networks that compute the same function may store their hidden units in a
different order; averaging them coordinate-wise then mixes unrelated units.
This module finds, for every permutation group of a model's
:class:`~alignfl.models.permutation.PermutationSpec`, the reordering of the second
model's units that best lines them up with the first's, solving one linear
assignment problem per group with :func:`scipy.optimize.linear_sum_assignment`.

Everything reads the spec and nothing else: a shared permutation (a ResNet
residual stream with its BatchNorm entries, a transformer's residual stream with
its embedding and LayerNorms, q and k of an attention head) is one group that
lists all of its axes, so its cost simply sums over all of them. A unit's row
is its row of :func:`~alignfl.models.permutation.unit_view` (built by :func:`unit_rows`),
so a flattened channel brings its whole block of ``H*W`` columns. State-dict
keys that no group touches are never changed; PAN encodings are not in state
dicts at all.

Speed (``benchmarks/matching_speed.py``): the reference's rows are built once
for all models aligned onto it (:class:`Target`), and each entry's share of a
group's score is kept until a permutation it depends on changes
(:class:`PairScores`), so the ``weight`` descent computes most shares once per
model instead of once per visit; the permutations found are the same.

Costs (registered by name, see :func:`list_costs`):

``weight``
    Weight matching of Ainsworth, Hayase and Srinivasa, "Git Re-Basin: Merging
    Models modulo Permutation Symmetries", ICLR 2023. For one group,
    maximise ``sum <W_ref, P W_other>`` over every entry touching the group, on
    its incoming *and* outgoing axes, with the other groups' current
    permutations applied to the entries' other axes. Groups are visited in a
    random order (coordinate descent) until a full sweep changes nothing, or
    :data:`MAX_SWEEPS` sweeps. Unlike Git Re-Basin, the descent starts from a
    sequential pass (as ``l1``, with inner products) rather than the identity;
    see :func:`weight_matching` for why.
``l1``
    Simple-FedMA (Holm, Sajjad and Matjasec, "L46 FedMA Project", project
    report): minimise the sum of absolute weight differences. Groups are solved
    once, in spec order (input side first). A group's cost uses every entry
    whose other permuted axes all belong to groups already solved, with those
    permutations applied: the incoming weights, bias and normalisation entries,
    plus the outgoing weights into a layer whose outputs are never permuted (the
    classifier), where the next layer's permutation is already fixed. Weights
    into a later, unsolved group are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from alignfl.models.permutation import AxisRef, PermutationSpec, permute_state

StateDict = Mapping[str, Tensor]
Permutations = dict[str, Tensor]
Score = Callable[[Tensor, Tensor], Tensor]

MAX_SWEEPS = 100
"""Cap on coordinate-descent sweeps of the ``weight`` cost (a sweep visits every group once)."""

# A new assignment replaces the current one only if it scores better by more than float noise,
# so ties (e.g. two identical units) never make the descent cycle or reorder units for nothing.
_IMPROVEMENT_RTOL = 1e-9


class Target:
    """The reference model that others are aligned onto, with its unit rows built once.

    Every model aligned onto the same reference (all clients of a round) reads
    the same reference rows, so they are made once per reference rather than
    once per client.
    """

    def __init__(self, reference: StateDict, spec: PermutationSpec) -> None:
        self.reference = reference
        self.spec = spec
        self.sizes = spec.group_sizes(reference)
        self.axes = spec.axes_by_key()
        self._rows: dict[AxisRef, Tensor] = {}

    def rows(self, ref: AxisRef) -> Tensor:
        """The reference's float32 ``J x F`` matrix of entry ``ref``, one row per unit."""
        if ref not in self._rows:
            self._rows[ref] = unit_rows(self.reference[ref.key], ref, ())
        return self._rows[ref]

    def identity(self, group: str) -> Tensor:
        return torch.arange(self.sizes[group])


Matcher = Callable[[Target, StateDict, torch.Generator], Permutations]


@dataclass(frozen=True)
class CostEntry:
    """One registered cost: how all groups of a model are matched, and its unit-to-unit score.

    ``score(reference_rows, other_rows)`` is the ``J x J`` matrix to maximise for
    one group, summed over the group's entries; the layer-wise FedMA schedule
    solves one group at a time with it.
    """

    name: str
    match: Matcher
    score: Score
    summary: str


_COSTS: dict[str, CostEntry] = {}


def register_cost(name: str, score: Score, summary: str) -> Callable[[Matcher], Matcher]:
    """Decorator registering ``match(target, other, generator) -> permutations`` under ``name``."""

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
            raise ValueError(
                f"state entry {key!r} has shape {tuple(other[key].shape)}, but {tuple(tensor.shape)} in the reference"
            )
    spec.group_sizes(reference)


def unit_rows(
    tensor: Tensor, ref: AxisRef, moves: Sequence[tuple[AxisRef, Tensor]], dtype: torch.dtype = torch.float32
) -> Tensor:
    """``unit_view(tensor, ref)`` as ``dtype`` after reordering the other axes by ``moves`` ((axis, permutation)
    pairs).

    Same rows as permuting with :func:`~alignfl.models.permutation.permute_axis` and
    then taking the unit view, but with at most one copy per move (or one for
    the layout when there is none): every permuted axis is split into
    ``(units, block)``, the units of ``ref`` are moved to the front as a view,
    and the other units are gathered from that view. Cost matrices are
    dominated by these copies and the matrix products.

    A move may also be a ``J x J`` matrix ``M`` (a relaxed permutation, as
    :mod:`alignfl.core.merging.universe` uses): new unit ``i`` is then ``sum_j M[i, j]`` times
    old unit ``j``; a permutation ``perm`` is the matrix with ``M[i, perm[i]] = 1``.
    """
    blocks = {axis.axis: axis.block for axis, _ in moves} | {ref.axis: ref.block}
    shape: list[int] = []
    units_at: dict[int, int] = {}
    for dim, length in enumerate(tensor.shape):
        units_at[dim] = len(shape)
        shape += [length // blocks[dim], blocks[dim]] if dim in blocks else [length]
    view = tensor.reshape(shape).movedim(units_at[ref.axis], 0)
    for axis, perm in moves:
        dim = units_at[axis.axis] + (units_at[axis.axis] < units_at[ref.axis])
        if perm.dim() == 1 and _is_identity(perm):
            continue  # the common case of models that start from one global model: no copy
        if perm.dim() == 1:
            view = view.index_select(dim, perm.to(device=tensor.device, dtype=torch.long))
        else:
            matrix = perm.to(device=tensor.device, dtype=dtype)
            view = torch.tensordot(matrix, view.to(dtype), dims=([1], [dim])).movedim(0, dim)
    return view.reshape(view.shape[0], -1).to(dtype)


def _is_identity(perm: Tensor) -> bool:
    return bool(torch.equal(perm.cpu(), torch.arange(len(perm), dtype=perm.dtype)))


def best_assignment(score: Tensor, current: Tensor) -> Tensor:
    """The permutation maximising ``sum_i score[i, perm[i]]``, or ``current`` unless strictly better.

    ``score[i, j]`` rates putting the other model's unit ``j`` at the
    reference's position ``i``; the result follows the spec's convention (new
    unit ``i`` is old unit ``perm[i]``). When ``current`` already takes every
    row's maximum it attains the bound no assignment exceeds, so the solver is
    skipped: the usual case when units barely move.
    """
    from scipy.optimize import linear_sum_assignment  # here: scipy.optimize's import costs a ClientApp 0.4 s

    matrix = score.detach().double().cpu().numpy()
    current_cols = current.cpu().numpy()
    if (matrix[np.arange(len(matrix)), current_cols] >= matrix.max(axis=1)).all():
        return current
    rows, cols = linear_sum_assignment(matrix, maximize=True)
    kept = matrix[rows, current_cols].sum()
    gain = matrix[rows, cols].sum() - kept
    if gain > _IMPROVEMENT_RTOL * max(abs(kept), 1.0):
        return torch.from_numpy(cols).long()
    return current


def _same(first: tuple[Tensor | None, ...], second: tuple[Tensor | None, ...]) -> bool:
    """Whether two tuples hold the very same permutation objects (a permutation is replaced, never edited)."""
    return len(first) == len(second) and all(a is b for a, b in zip(first, second))


class PairScores:
    """Score matrices for aligning one model onto a :class:`Target`, built entry by entry.

    A group's score is a sum over its entries (both scores add up over
    feature blocks). Each entry's share depends only on the permutations of
    the entry's *other* axes, which are applied to the other model before its
    rows are compared with the reference's, so a share is cached until one of
    those permutations is replaced. Coordinate descent mostly changes one
    group at a time, so most shares are computed once per model; and a group
    none of whose inputs changed since it was last solved is not solved again
    (the solver is deterministic, so the answer would be the same).
    """

    def __init__(self, target: Target, other: StateDict, score: Score) -> None:
        self.target = target
        self.other = other
        self.score = score
        self._shares: dict[AxisRef, tuple[tuple[Tensor | None, ...], Tensor]] = {}
        self._settled: dict[str, tuple[tuple[AxisRef, ...], tuple[Tensor | None, ...]]] = {}

    def _inputs(self, ref: AxisRef, perms: Mapping[str, Tensor]) -> tuple[Tensor | None, ...]:
        """The permutations (None: not solved yet) of the other axes of ``ref``'s entry."""
        return tuple(perms.get(name) for name, axis in self.target.axes[ref.key] if axis.axis != ref.axis)

    def share(self, ref: AxisRef, perms: Mapping[str, Tensor]) -> Tensor:
        """Entry ``ref``'s ``J x J`` share of its group's score under ``perms``."""
        inputs = self._inputs(ref, perms)
        cached = self._shares.get(ref)
        if cached is not None and _same(cached[0], inputs):
            return cached[1]
        moves = [
            (axis, perms[name])
            for name, axis in self.target.axes[ref.key]
            if axis.axis != ref.axis and perms.get(name) is not None
        ]
        share = self.score(self.target.rows(ref), unit_rows(self.other[ref.key], ref, moves))
        self._shares[ref] = (inputs, share)
        return share

    def solve(self, group: str, refs: Sequence[AxisRef], perms: Mapping[str, Tensor]) -> Tensor:
        """The best permutation of ``group`` from the entries ``refs``, keeping the current one on ties.

        The current one is ``perms[group]``, or the identity while the group is
        unsolved; the identity is also the answer when ``refs`` is empty (no evidence).
        """
        current = perms.get(group)
        if current is None:
            current = self.target.identity(group)
        if not refs:
            return current
        inputs = tuple(dep for ref in refs for dep in self._inputs(ref, perms))
        settled = self._settled.get(group)
        if settled is not None and settled[0] == tuple(refs) and _same(settled[1], (current, *inputs)):
            return current
        perm = best_assignment(sum(self.share(ref, perms) for ref in refs), current)
        self._settled[group] = (tuple(refs), (perm, *inputs))
        return perm


def solved_refs(spec: PermutationSpec, group: str, solved: Iterable[str]) -> list[AxisRef]:
    """The entries of ``group`` whose other permuted axes all belong to ``solved`` groups."""
    done, axes = set(solved), spec.axes_by_key()
    return [
        ref
        for ref in spec.groups[group]
        if all(name in done for name, other in axes[ref.key] if other.axis != ref.axis)
    ]


def solve_group(
    reference: StateDict,
    other: StateDict,
    spec: PermutationSpec,
    group: str,
    solved: Mapping[str, Tensor],
    score: Score,
) -> Tensor:
    """The permutation of ``group`` given the groups in ``solved`` (name -> their permutation).

    The rows use :func:`solved_refs`: entries whose other permuted axes all
    belong to solved groups, with those permutations applied. The identity
    wins ties, and is the answer when no such entry exists (no evidence).
    """
    scores = PairScores(Target(reference, spec), other, score)
    return scores.solve(group, solved_refs(spec, group, solved), solved)


def sequential_matching(
    scores: PairScores, groups: Iterable[str] | None = None, solved: Mapping[str, Tensor] | None = None
) -> Permutations:
    """Solve each of ``groups`` (default: all) once, in the order given (spec order: input side first), from the
    entries already aligned; ``solved`` holds groups whose permutations are known beforehand (and stay)."""
    spec = scores.target.spec
    perms: Permutations = dict(solved or {})
    for name in spec.groups if groups is None else groups:
        perms[name] = scores.solve(name, solved_refs(spec, name, perms), perms)
    return perms


def coordinate_descent(
    scores: PairScores,
    perms: Permutations,
    refs: Mapping[str, Sequence[AxisRef]],
    generator: torch.Generator,
) -> Permutations:
    """Improve ``perms`` in place: visit the groups named in ``refs`` in a random order, each solved from its
    entries ``refs[group]`` given the others' current permutations, until a sweep changes nothing or
    :data:`MAX_SWEEPS` sweeps; returns ``perms``."""
    names = list(refs)
    for _ in range(MAX_SWEEPS):
        changed = False
        for index in torch.randperm(len(names), generator=generator).tolist():
            name = names[index]
            perm = scores.solve(name, refs[name], perms)
            if perm is not perms[name]:
                perms[name], changed = perm, True
        if not changed:
            break
    return perms


# --- costs ----------------------------------------------------------------------------


def inner_products(reference_rows: Tensor, other_rows: Tensor) -> Tensor:
    """``<ref unit i, other unit j>``: maximising their sum is minimising the squared L2 distance."""
    return reference_rows @ other_rows.T


def negative_l1(reference_rows: Tensor, other_rows: Tensor) -> Tensor:
    """``-sum |ref unit i - other unit j|``, Simple-FedMA's cost as a score to maximise."""
    return -torch.cdist(reference_rows, other_rows, p=1)


@register_cost("weight", inner_products, "Git Re-Basin weight matching: coordinate descent on sum <W_ref, P W_other>")
def weight_matching(target: Target, other: StateDict, generator: torch.Generator) -> Permutations:
    """Coordinate descent over all groups, in random order, until a sweep changes nothing.

    Starts from :func:`sequential_matching` with inner products instead of the
    identity that Git Re-Basin starts from: from the identity, a pair of
    neighbouring groups can lock each other into a wrong order (twocnn's last
    conv and first FC share a large weight matrix whose two permutations are
    each the other's best response), so even an exactly permuted copy would not
    be recovered. The descent only accepts strict improvements, so it never
    leaves an exact match.
    """
    scores = PairScores(target, other, inner_products)
    return coordinate_descent(scores, sequential_matching(scores), target.spec.groups, generator)


@register_cost("l1", negative_l1, "Simple-FedMA: sum of absolute differences, groups solved in order from the input")
def l1_matching(target: Target, other: StateDict, generator: torch.Generator) -> Permutations:
    """One pass from the input side (``generator`` is unused: the order is fixed)."""
    return sequential_matching(PairScores(target, other, negative_l1))


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
    return entry.match(Target(reference, spec), other, generator or torch.Generator().manual_seed(0))


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

    The arithmetic is FedAvg's (each entry times its share, then summed in order), so an alignment that moves
    no unit merges to FedAvg's model bit for bit rather than to one an ulp away that long local training grows
    into points. Integer entries (BatchNorm's ``num_batches_tracked``) cannot be averaged and are taken from
    the first state.
    """
    _check_weights(states, weights)
    total = sum(weights)
    shares = [weight / total for weight in weights]
    averaged: dict[str, Tensor] = {}
    for key, first in states[0].items():
        if not torch.is_floating_point(first):
            averaged[key] = first.clone()
            continue
        averaged[key] = first * shares[0]
        for state, share in zip(states[1:], shares[1:]):
            averaged[key] += state[key] * share
    return averaged


def _check_weights(states: Sequence[StateDict], weights: Sequence[float]) -> None:
    if not states or len(states) != len(weights):
        raise ValueError(
            f"need one weight per state and at least one state, got {len(states)} states and {len(weights)} weights"
        )
    if any(not w > 0 for w in weights):
        raise ValueError(f"weights must be positive, got {list(weights)}")


def matching_generator(seed: int, server_round: int) -> torch.Generator:
    """The generator of a round's matching (weight matching visits permutations in a random order): a function
    of the run's seed and the round, so the server and the offline ``merge`` tool match alike."""
    return torch.Generator().manual_seed(seed * 10_007 + server_round)


def moved_share(permutations: Sequence[Mapping[str, Tensor]]) -> dict[str, float]:
    """Per group, the share of units a matching moved (``perm[i] != i``), averaged over the clients."""
    groups = permutations[0].keys() if permutations else ()
    return {
        group: float(
            sum((p[group] != torch.arange(len(p[group]))).double().mean() for p in permutations) / len(permutations)
        )
        for group in groups
    }


def mean_share(shares: Mapping[str, float]) -> float:
    """The mean over groups of a per-group share (:func:`moved_share`), 0 for none: the log's one figure."""
    return sum(shares.values()) / max(len(shares), 1)


def align_and_average(
    reference: StateDict,
    states: Sequence[StateDict],
    weights: Sequence[float],
    spec: PermutationSpec,
    cost: str = "weight",
    iterations: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """Align every state onto ``reference``, then average them weighted by ``weights``; also returns each
    state's permutations (of the last pass).

    With ``iterations > 1`` the states are aligned again onto the matched mean
    of the previous iteration, which moves the target from the reference to
    the clients' consensus (the reference only fixes the unit order at first).
    Every input is checked before any matching starts.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    _check_weights(states, weights)
    match = get_cost(cost).match
    for state in states:
        check_compatible(reference, state, spec)
    generator = generator or torch.Generator().manual_seed(0)
    target: StateDict = reference
    permutations: list[dict[str, Tensor]] = []
    for _ in range(iterations):
        shared = Target(target, spec)  # one set of reference rows for every state
        permutations = [dict(match(shared, state, generator)) for state in states]
        target = weighted_average(
            [permute_state(spec, state, perms) for state, perms in zip(states, permutations)], weights
        )
    return dict(target), permutations
