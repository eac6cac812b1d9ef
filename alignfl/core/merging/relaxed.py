"""Relaxed permutations for universe matching's Frank-Wolfe (:mod:`alignfl.core.merging.universe`), and its exact line
search.

A *move* carries one model's units of one permutation group: a permutation (1-D, a vertex of the relaxed set) or
a ``J x J`` doubly stochastic matrix (new unit ``u`` is ``sum_a X[u, a]`` times old unit ``a``). An entry of a state
dict is carried by the moves of the groups on its axes; along the segment ``(1 - t) X + t S`` between two plans
every entry's image is a polynomial in ``t`` of degree its number of moved axes, so the universe objective, a sum
of inner products of images, is a polynomial of degree at most twice that (4 for every model here). Its
coefficients come from inner products of a few carried copies, and its maximum on ``[0, 1]`` is among 0, 1 and the
roots of its derivative: the line search is exact.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from alignfl.core.merging.alignment import StateDict, unit_rows
from alignfl.models.permutation import AxisRef

DTYPE = torch.float64
"""Every carried copy's precision, so that the line search's polynomial is not swamped by rounding."""

Move = Tensor
"""A permutation (1-D, a vertex of the relaxed set) or a ``J x J`` doubly stochastic matrix."""


@dataclass(frozen=True)
class Entry:
    """A state entry taking part: its key and its free axes ``(group, axis)``, in spec order (fixed axes need
    no move: every model holds them in one order)."""

    key: str
    axes: tuple[tuple[str, AxisRef], ...]


def lead(move: Move, rows: Tensor) -> Tensor:
    """``rows`` (one per unit) carried by ``move``: new row ``u`` is ``sum_a move[u, a] rows[a]``."""
    return rows.index_select(0, move) if move.dim() == 1 else move @ rows


def dense(move: Move) -> Tensor:
    """``move`` as a ``J x J`` matrix."""
    if move.dim() == 2:
        return move
    matrix = torch.zeros(len(move), len(move), dtype=DTYPE)
    matrix[torch.arange(len(move)), move] = 1.0
    return matrix


def entry_rows(state: StateDict, entry: Entry, axis: int, plan: Mapping[str, Move]) -> Tensor:
    """Entry ``entry`` of ``state``, unit rows along its ``axis``-th free axis, the other free axes carried by
    ``plan`` (group -> move)."""
    _, ref = entry.axes[axis]
    moves = [(other, plan[name]) for name, other in entry.axes if other != ref]
    return unit_rows(state[entry.key], ref, moves, DTYPE)


def line_polynomial(
    entries: Sequence[Entry],
    states: Sequence[StateDict],
    plans: Sequence[Mapping[str, Move]],
    vertices: Sequence[Mapping[str, Move]],
    images: Sequence[Mapping[str, Tensor]],
) -> np.ndarray:
    """Coefficients (lowest degree first) of the objective along ``plans + t (vertices - plans)``; ``images``: every
    model's entries carried by its plan, in the first free axis's layout.

    An entry with ``m`` free axes carried by ``(1 - t) X + t S`` on each is ``sum_k (1 - t)^(m - k) t^k C_k``,
    ``C_k`` summing the copies with ``S`` on ``k`` of its axes and ``X`` on the others.
    """
    degree = 2 * max((len(entry.axes) for entry in entries), default=0)
    polynomial = np.zeros(degree + 1)
    for entry in entries:
        m = len(entry.axes)
        totals: list[Tensor | float] = [0.0] * (m + 1)  # monomial coefficient tensors, summed over the models
        own = np.zeros(2 * m + 1)  # sum over the models of <D_i(t), D_i(t)>
        for state, plan, vertex, image in zip(states, plans, vertices, images):
            bernstein: list[Tensor | float] = [0.0] * (m + 1)
            for mask in itertools.product((False, True), repeat=m):
                if not any(mask):
                    copy = image[entry.key]
                else:
                    choice = {name: (vertex if s else plan)[name] for (name, _), s in zip(entry.axes, mask)}
                    copy = lead(choice[entry.axes[0][0]], entry_rows(state, entry, 0, choice))
                bernstein[sum(mask)] = bernstein[sum(mask)] + copy
            monomial = [
                sum(
                    math.comb(m - k, d - k) * (-1) ** (d - k) * bernstein[k]
                    for k in range(d + 1)
                    if isinstance(bernstein[k], Tensor)
                )
                for d in range(m + 1)
            ]
            for d, tensor in enumerate(monomial):
                totals[d] = totals[d] + tensor
            for d, e in itertools.product(range(m + 1), repeat=2):
                own[d + e] += float((monomial[d] * monomial[e]).sum())
        for d, e in itertools.product(range(m + 1), repeat=2):
            polynomial[d + e] += 0.5 * float((totals[d] * totals[e]).sum())
        polynomial[: 2 * m + 1] -= 0.5 * own
    return polynomial


def best_step(polynomial: np.ndarray) -> tuple[float, float]:
    """The ``t`` in ``[0, 1]`` maximising the polynomial (the smallest among equals), and the gain over ``t = 0``."""
    derivative = polynomial[1:] * np.arange(1, len(polynomial))
    roots = np.roots(derivative[::-1]) if np.any(derivative) else np.array([])
    inside = [float(r.real) for r in roots if abs(r.imag) <= 1e-9 and 0.0 < r.real < 1.0]
    candidates = sorted({0.0, 1.0, *inside})
    values = [float(np.polyval(polynomial[::-1], t)) for t in candidates]
    best = max(range(len(candidates)), key=lambda k: (values[k], -candidates[k]))
    return candidates[best], values[best] - values[0]
