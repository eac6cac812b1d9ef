"""Match many models at once into one shared unit order, a "universe", so that all pairwise maps agree.

Crisostomi, Fumero, Baieri, Bernard and Rodolà, "C2M3: Cycle-Consistent
Multi-Model Merging", NeurIPS 2024.

Aligning each of N models onto one reference (:mod:`alignfl.core.merging.alignment`) gives N
independent pairwise matchings: the map from model i to model j through the
reference need not be the map a direct matching of i and j finds. Here every
model i gets one permutation ``P_i`` per permutation group of the model's
:class:`~alignfl.models.permutation.PermutationSpec`, carrying its units to universe
positions; the map from model i to model j is ``P_j^T P_i``, so every cycle
of maps composes to the identity by construction (the paper writes
``P_BA = P_B P_A^T``, its ``P_A^T`` being this ``P_A``).

Objective
---------
Write ``P_i . W_i`` for model i's state with each of its permutations applied
on the axes its group acts on (every entry of the spec: weights on their
incoming and outgoing axes, biases, normalisation entries). The objective is
the sum over all pairs ``i < j`` of ``<P_i . W_i, P_j . W_j>``, which for
every pair is Git Re-Basin's weight-matching similarity ``<W_i, P W_j Q^T>``
(Ainsworth, Hayase and Srinivasa, ICLR 2023) with ``P = P_i^T P_j``, layer by
layer: the same terms as :mod:`alignfl.core.merging.alignment`'s ``weight`` cost. With
``A_i = P_i . W_i`` it equals ``(|sum_i A_i|^2 - sum_i |A_i|^2) / 2``.

Frank-Wolfe
-----------
Each ``P_i`` is relaxed to a doubly stochastic matrix ``X_i`` (new unit ``u`` is
``sum_a X[u, a]`` times old unit ``a``). An iteration

1. linearises: the gradient for model i and group g sums, over the entries g
   acts on, the weight cost's score (:func:`alignfl.core.merging.alignment.inner_products`)
   between the unit rows of ``sum_{j != i} A_j`` and model i's unit rows with its
   other axes carried by its current ``X_i`` (:func:`alignfl.core.merging.alignment.unit_rows`,
   which takes relaxed matrices as moves);
2. solves one linear assignment per model and group
   (:func:`scipy.optimize.linear_sum_assignment`, maximising) for the vertex
   ``S_i``;
3. steps to ``X + t (S - X)`` with an exact line search
   (:mod:`alignfl.core.merging.relaxed`: along that segment the objective is a
   polynomial in ``t``, maximised on ``[0, 1]`` among 0, 1 and the roots of its
   derivative). ``t = 0`` is a candidate, so the relaxed objective never
   decreases;
4. stops when the step would raise the objective by less than ``tolerance``
   times its value (the step is then not taken), or after ``iterations``
   iterations.

Then each relaxed ``X_i`` is projected to a permutation by one linear
assignment, and the universe order is fixed to model 0's (``P_0 = I`` after
composing every ``P_i`` with ``P_0^T``): :attr:`UniverseMatch.permutations`
carry each model into model 0's unit order, so the merge
(:func:`universe_merge`, the example-weighted mean of the carried models) is in
model 0's coordinates.

Where this differs from the authors' code (crisostomi/cycle-consistent-model-merging)
-----------------------------------------------------------------------------------
* **Start.** The authors' code has three starts for every ``X_i``: the
  identity, a random matrix, and Sinkhorn (a randomly perturbed uniform matrix
  made doubly stochastic). The identity is the default of their matcher's
  configuration, but their N-model merger (``merge_n_models``, the one that
  merges the models it matches) starts from Sinkhorn. Here model 0 starts at
  the identity and every other model at its pairwise weight matching onto
  model 0 (:mod:`alignfl.core.merging.alignment`'s ``weight`` cost),
  ``start="pairwise"``; the identity start is kept as ``start="identity"``.
  From the identity, the linearised step sums every other model's scores and
  can settle in a wrong joint order even for exactly permuted copies of one
  model; from the pairwise start those copies are recovered exactly, and with
  N = 2 the result is the pairwise weight matching (a coordinate-wise optimum
  is a fixed point of the linearised step). The pairwise start stays the
  default: run beside the authors' code on this project's one-shot clients, it
  reached a higher objective, and better merges, than both their identity and
  their Sinkhorn start.
* **Iteration cap.** 100 by default (:class:`UniverseSettings`); the authors'
  matcher and merger both cap at 200.
* **Step.** An exact line search (above) instead of their bounded scalar search
  (scipy's ``fminbound``, 20 evaluations, ``xtol`` 1e-3).
* **Stopping.** A relative tolerance, stopping at the first iteration below it;
  theirs is an absolute 1e-6 with a patience of 5 iterations.
* **Projection.** If the projected permutations score below the start, the
  start is returned (theirs always returns the projection).
* **Merge.** Weighted by example counts, in model 0's unit order, no REPAIR
  (theirs: the plain mean in the universe's order, then REPAIR on data).
* **Partial problems.** Some groups may be held fixed (already in one order in
  every model) and only entries whose groups are all free or fixed take part:
  FedMA's layer-wise stages match one group at a time this way.
* **Precision.** float64 throughout, so that the line search's polynomial is
  not swamped by rounding.

Cycle-consistency of reference-based matching
---------------------------------------------
:func:`cycle_consistency_error` measures what the universe avoids: per group,
the share of units on which the direct pairwise weight matching of model j
onto model i disagrees with the composition through a reference (j onto the
reference, then the reference onto i), averaged over pairs (at most
:data:`MAX_PAIRS` pairs, drawn at random when there are more).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from alignfl.core.merging.alignment import (
    PairScores,
    Permutations,
    StateDict,
    Target,
    _check_weights,
    best_assignment,
    check_compatible,
    coordinate_descent,
    inner_products,
    sequential_matching,
    weighted_average,
)
from alignfl.core.merging.relaxed import DTYPE, Entry, Move, best_step, dense, entry_rows, lead, line_polynomial
from alignfl.models.permutation import PermutationSpec, permute_state
from alignfl.plugins.options import check_fields, option, positive

STARTS = ("pairwise", "identity")
"""Where Frank-Wolfe starts (module notes): every model's pairwise weight matching onto model 0, or the identity."""
MAX_PAIRS = 10
"""Most pairs of models :func:`cycle_consistency_error` compares (drawn at random when there are more)."""


@dataclass(frozen=True)
class UniverseSettings:
    """Frank-Wolfe's settings, declared once here; the ``matched`` and ``fedma`` strategies borrow them under
    their own keys (:class:`alignfl.core.merging.reference.Reference`) and the merge tool as ``--universe-<field>``."""

    iterations: int = option(
        100, "Frank-Wolfe iteration cap of universe matching", lambda v: v >= 1, "must be an integer >= 1"
    )
    tolerance: float = option(
        1e-6,
        "universe matching stops once an iteration would raise its objective by less than this share of it",
        positive,
        "must be a finite number > 0",
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class UniverseMatch:
    """The result of :func:`universe_matching`.

    Attributes
    ----------
    permutations : list of dict of str to Tensor
        Per model, group name -> the permutation carrying the model into model 0's unit order (apply with
        :func:`~alignfl.models.permutation.permute_state`); model 0's are the identity.
    objective : list of float
        The relaxed objective at the start and after each Frank-Wolfe step taken (never decreasing).
    projected : float
        The objective of the returned permutations.
    """

    permutations: list[dict[str, Tensor]]
    objective: list[float]
    projected: float


def universe_diagnostics(match: UniverseMatch, cycle: Mapping[str, float]) -> dict[str, Any]:
    """What a universe merge records of itself: Frank-Wolfe's objective per iteration (``universe-objective``),
    that of the returned permutations (``universe-projected``) and, per group, the ``cycle-consistency-error``
    that aligning onto a reference would have had (:func:`cycle_consistency_error`)."""
    return {
        "universe-objective": match.objective,
        "universe-projected": match.projected,
        "cycle-consistency-error": dict(cycle),
    }


class _Problem:
    """Which groups are free, which fixed, which entries take part, and each free group's entries."""

    def __init__(
        self, spec: PermutationSpec, state: StateDict, groups: Iterable[str] | None, fixed: Collection[str]
    ) -> None:
        free = list(spec.groups) if groups is None else list(groups)
        unknown = sorted((set(free) | set(fixed)) - set(spec.groups))
        if unknown:
            raise ValueError(f"unknown permutation groups {unknown}; allowed: {list(spec.groups)}")
        if set(free) & set(fixed) or len(set(free)) != len(free):
            raise ValueError(f"groups {free} must be distinct and none of them fixed ({sorted(fixed)})")
        self.spec, self.free, self.fixed = spec, free, frozenset(fixed)
        self.sizes = spec.group_sizes(state)
        known = set(free) | self.fixed
        axes = spec.axes_by_key()
        self.entries = [
            Entry(key, tuple((name, ref) for name, ref in refs if name in free))
            for key, refs in axes.items()
            if {name for name, _ in refs} <= known and any(name in free for name, _ in refs)
        ]
        self.refs = {
            group: [ref for ref in spec.groups[group] if all(n in known for n, _ in axes[ref.key])] for group in free
        }


# --- pairwise weight matching, restricted to a problem's groups --------------------------------------------------


def pairwise_matching(
    reference: StateDict,
    other: StateDict,
    spec: PermutationSpec,
    groups: Iterable[str] | None = None,
    fixed: Collection[str] = (),
    generator: torch.Generator | None = None,
) -> Permutations:
    """Group name -> permutation aligning ``other`` onto ``reference`` by :mod:`alignfl.core.merging.alignment`'s weight
    matching, restricted to ``groups`` with ``fixed`` at the identity as in :func:`universe_matching` (every group:
    exactly :func:`alignfl.core.merging.alignment.find_permutations` with the ``weight`` cost)."""
    check_compatible(reference, other, spec)
    problem = _Problem(spec, reference, groups, fixed)
    return _pairwise(Target(reference, spec), other, problem, generator or torch.Generator().manual_seed(0))


def _pairwise(target: Target, other: StateDict, problem: _Problem, generator: torch.Generator) -> Permutations:
    """``alignfl.core.merging.alignment``'s weight matching of ``other`` onto ``target`` over the problem's free groups
    (the fixed ones at the identity, entries touching other groups left out); with every group free, exactly its
    ``weight`` cost."""
    scores = PairScores(target, other, inner_products)
    identity = {group: target.identity(group) for group in problem.fixed}
    perms = sequential_matching(scores, problem.free, identity)
    coordinate_descent(scores, perms, {group: problem.refs[group] for group in problem.free}, generator)
    return {group: perms[group] for group in problem.free}


# --- Frank-Wolfe --------------------------------------------------------------------------------------------------


def _gradients(
    problem: _Problem, states: Sequence[StateDict], plans: Sequence[Mapping[str, Move]]
) -> tuple[float, list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """The objective at ``plans``, its gradient per model and group (``[universe unit, model unit]``), and every
    model's images of the entries in the first free axis's layout (reused by the line search)."""
    value = 0.0
    gradients = [{group: torch.zeros(n, n, dtype=DTYPE) for group, n in _free_sizes(problem).items()} for _ in states]
    images: list[dict[str, Tensor]] = [{} for _ in states]
    for entry in problem.entries:
        for axis, (group, _) in enumerate(entry.axes):
            rows = [entry_rows(state, entry, axis, plan) for state, plan in zip(states, plans)]
            carried = [lead(plan[group], r) for plan, r in zip(plans, rows)]
            total = torch.stack(carried).sum(dim=0)
            for gradient, mine, r in zip(gradients, carried, rows):
                gradient[group] += inner_products(total - mine, r)
            if axis == 0:
                value += 0.5 * (total.square().sum() - sum(c.square().sum() for c in carried)).item()
                for image, c in zip(images, carried):
                    image[entry.key] = c
    return value, gradients, images


def _same_vertex(plan: Mapping[str, Move], vertex: Mapping[str, Move]) -> bool:
    """Whether ``plan`` is the vertex ``vertex`` (every group's move the same permutation)."""
    return all(plan[g].dim() == 1 and torch.equal(plan[g], vertex[g]) for g in vertex)


def _free_sizes(problem: _Problem) -> dict[str, int]:
    return {group: problem.sizes[group] for group in problem.free}


def _objective(problem: _Problem, states: Sequence[StateDict], plans: Sequence[Mapping[str, Move]]) -> float:
    value = 0.0
    for entry in problem.entries:
        group = entry.axes[0][0]
        carried = [lead(plan[group], entry_rows(state, entry, 0, plan)) for state, plan in zip(states, plans)]
        value += 0.5 * (torch.stack(carried).sum(dim=0).square().sum() - sum(c.square().sum() for c in carried)).item()
    return value


def universe_matching(
    states: Sequence[StateDict],
    spec: PermutationSpec,
    settings: UniverseSettings | None = None,
    groups: Iterable[str] | None = None,
    fixed: Collection[str] = (),
    start: str = "pairwise",
    generator: torch.Generator | None = None,
) -> UniverseMatch:
    """Match all ``states`` jointly into one universe by Frank-Wolfe (module notes).

    Parameters
    ----------
    states : sequence of state dicts
        N >= 1 models of one architecture described by ``spec``.
    spec : PermutationSpec
        The model's permutation description.
    settings : UniverseSettings, optional
        Iteration cap and tolerance (default: :class:`UniverseSettings`'s defaults).
    groups : iterable of str, optional
        The groups to match (default: all); the others are left alone.
    fixed : collection of str
        Groups whose units already stand in one order in every model; entries touching a group neither in
        ``groups`` nor in ``fixed`` are left out of the objective.
    start : str
        ``pairwise`` (each model's weight matching onto model 0) or ``identity`` (the authors' matcher's default;
        their N-model merger starts from Sinkhorn, which is not offered here).
    generator : torch.Generator, optional
        Drives the pairwise start's random visiting order (default: seed 0).

    Returns
    -------
    UniverseMatch
        Each model's permutations into model 0's unit order (the matched groups only) and the objective values.

    Examples
    --------
    >>> from models import build_model, permute_state, random_permutations
    >>> model = build_model("small-mlp", (1, 8, 8), 10)
    >>> spec, state = model.permutation_spec(), model.state_dict()
    >>> copy = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(1)))
    >>> match = universe_matching([state, copy], spec)
    >>> all(torch.equal(a, b) for a, b in zip(permute_state(spec, copy, match.permutations[1]).values(), state.values()))
    True
    """
    settings = settings or UniverseSettings()
    if start not in STARTS:
        raise ValueError(f"unknown universe start {start!r}; allowed: {list(STARTS)}")
    if not states:
        raise ValueError("universe matching needs at least one state")
    for state in states[1:]:
        check_compatible(states[0], state, spec)
    problem = _Problem(spec, states[0], groups, fixed)
    generator = generator or torch.Generator().manual_seed(0)
    keys = {entry.key for entry in problem.entries}
    wide = [{key: state[key].to(DTYPE) for key in keys} for state in states]

    identity = {group: torch.arange(n) for group, n in _free_sizes(problem).items()}
    if start == "pairwise" and len(states) > 1:
        target = Target(states[0], spec)
        starts = [dict(identity)] + [_pairwise(target, state, problem, generator) for state in states[1:]]
    else:
        starts = [dict(identity) for _ in states]

    plans: list[dict[str, Move]] = [dict(plan) for plan in starts]
    objective: list[float] = []
    for _ in range(settings.iterations):
        value, gradients, images = _gradients(problem, wide, plans)
        if not objective:
            objective.append(value)
        vertices = [
            {
                group: best_assignment(gradient[group], plan[group] if plan[group].dim() == 1 else identity[group])
                for group in problem.free
            }
            for plan, gradient in zip(plans, gradients)
        ]
        if all(_same_vertex(plan, vertex) for plan, vertex in zip(plans, vertices)):
            break  # a fixed point: the linearised step points nowhere
        step, gain = best_step(line_polynomial(problem.entries, wide, plans, vertices, images))
        if gain <= settings.tolerance * max(abs(value), 1e-12):
            break
        plans = [
            dict(vertex) if step == 1.0 else {g: (1 - step) * dense(plan[g]) + step * dense(vertex[g]) for g in plan}
            for plan, vertex in zip(plans, vertices)
        ]
        objective.append(value + gain)

    projected = [
        {
            group: move if move.dim() == 1 else best_assignment(move, torch.arange(len(move)))
            for group, move in plan.items()
        }
        for plan in plans
    ]
    score = objective[0]  # the start's
    if not all(_same_vertex(plan, start) for plan, start in zip(projected, starts)):
        moved = _objective(problem, wide, projected)
        projected, score = (projected, moved) if moved >= score else (starts, score)
    first = {group: torch.argsort(perm) for group, perm in projected[0].items()}
    return UniverseMatch(
        [{group: perm[first[group]] for group, perm in plan.items()} for plan in projected], objective, score
    )


def universe_merge(
    states: Sequence[StateDict],
    weights: Sequence[float],
    spec: PermutationSpec,
    settings: UniverseSettings | None = None,
    generator: torch.Generator | None = None,
) -> tuple[dict[str, Tensor], UniverseMatch]:
    """Match ``states`` into one universe (:func:`universe_matching`, every group), then average them in model
    0's unit order weighted by ``weights`` (e.g. example counts); also returns the match."""
    _check_weights(states, weights)
    match = universe_matching(states, spec, settings, generator=generator)
    aligned = [permute_state(spec, state, perms) for state, perms in zip(states, match.permutations)]
    return weighted_average(aligned, weights), match


def cycle_consistency_error(
    reference: StateDict,
    states: Sequence[StateDict],
    spec: PermutationSpec,
    groups: Iterable[str] | None = None,
    fixed: Collection[str] = (),
    max_pairs: int = MAX_PAIRS,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """Per group, the share of units where reference-based matching is not cycle-consistent (module notes).

    For each compared pair ``i < j`` of ``states``: model j's weight matching onto model i, against the
    composition of j's matching onto ``reference`` with the inverse of i's; the share of model i's units they
    carry to different units of model j, averaged over the pairs (at most ``max_pairs``, drawn with
    ``generator`` when there are more). ``groups`` and ``fixed`` restrict the matchings as in
    :func:`universe_matching`. Empty with fewer than two states.
    """
    if max_pairs < 1:
        raise ValueError(f"max_pairs must be >= 1, got {max_pairs}")
    for state in states:
        check_compatible(reference, state, spec)
    problem = _Problem(spec, reference, groups, fixed)
    pairs = list(itertools.combinations(range(len(states)), 2))
    if not pairs:
        return {}
    generator = generator or torch.Generator().manual_seed(0)
    if len(pairs) > max_pairs:
        pairs = [pairs[k] for k in sorted(torch.randperm(len(pairs), generator=generator)[:max_pairs].tolist())]
    # every matching visits the groups in one order: two runs of one problem then agree, so what is counted is
    # the disagreement of the maps, not that of coordinate descent's random visiting orders
    order = int(torch.randint(0, 2**62, (1,), generator=generator))

    def matching(target: Target, other: StateDict) -> Permutations:
        return _pairwise(target, other, problem, torch.Generator().manual_seed(order))

    used = sorted({index for pair in pairs for index in pair})
    via = {index: matching(Target(reference, spec), states[index]) for index in used}
    errors = dict.fromkeys(problem.free, 0.0)
    for i, j in pairs:
        direct = matching(Target(states[i], spec), states[j])
        for group in problem.free:
            composed = via[j][group][torch.argsort(via[i][group])]
            errors[group] += float((direct[group] != composed).double().mean()) / len(pairs)
    return errors
