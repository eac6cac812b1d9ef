"""FedMA's Bayesian non-parametric matching (BBP-MAP), vectorised: its settings and the matching of units.

:mod:`alignfl.core.merging.bbp_model` applies it to any model with a permutation spec, one group of units at a time.

PFNM (Yurochkin et al., ICML 2019) and FedMA (Wang et al., ICLR 2020) treat the
hidden units of one layer, pooled over K clients, as noisy draws of global
*atoms* of a Beta-Bernoulli process: each atom is a Gaussian
``N(mu0, sigma0)`` vector, each client observes some of the atoms once, with
noise ``N(0, sigma)``. BBP-MAP finds the MAP assignment of every client unit
to an atom, and opens a new atom when no existing one explains a unit well
enough, so the global layer can be wider than any client's (up to
``max_width``). One client at a time is taken out and re-assigned with the
Hungarian algorithm over an extended cost matrix: a column per existing atom,
plus a block of "new atom" columns.

Cost (to maximise) of putting client unit ``x_l`` on atom ``i``, with
``y = x / sigma``, ``N_i = mu0 / sigma0 + sum of y over the atom's members``
(the client being matched left out), ``P_i = 1 / sigma0 + n_i / sigma``
(``sigma``, ``sigma0`` are variances, as in the authors' code) and ``K``
clients::

    existing atom i:  ||y_l + N_i||^2 / (P_i + 1/sigma) - ||N_i||^2 / P_i + log(c_i / (K - c_i)),
                      c_i = min(n_i, 10)
    new atom, t-th:   ||y_l + mu0/sigma0||^2 / (1/sigma0 + 1/sigma) - D mu0^2 / sigma0
                      - 2 log t + 2 log(gamma / K)

The new-atom block has one column per client unit (``t = 1 .. J``); all its
columns score alike except for ``-2 log t``, so opening ``n`` atoms costs
``2 log n!``, the Indian-buffet prior on new dishes. The whole matrix is built
with one matrix product per client (:func:`extended_cost`) and solved with
:func:`scipy.optimize.linear_sum_assignment`.

What follows the authors' code (IBM/FedMA ``matching/pfnm.py``'s
``layer_wise_group_descent`` and ``match_layer``, as main.py's ``BBP_MAP``
calls them): the cost terms above, including the popularity count capped at
10 and the ``2 log t`` penalties; the defaults sigma = sigma0 = 1, mu0 = 0,
gamma = 7, a cap of 700 units and 5 sweeps; the initialisation (the widest
client's units become the atoms, the others are matched in turn, widest
first); each sweep removing one client at a time, in a random order, deleting
atoms left without members, and matching it again; new atoms appended in the
order of the client's units; posterior means as the global units; missing
inputs (a client's units do not cover every global input) read as zeros; the
last hidden layer's units matched on their incoming weights and bias only,
without the output layer's weights (``include_classifier`` adds them); the
output layer never matched but averaged, per class with class counts; the
cost computed in float32 for float32 models.

Where this deviates:

* **Prior mean.** One ``mu0`` (default 0) for every coordinate. The authors'
  prior mean is 0 except for one coordinate at 0.1 (their ``mu0_bias``; its
  variance is sigma0 like the rest's). In the first layer they lay the prior
  out as the data, ``[weights, bias]``, so the 0.1 is the bias's; in every
  later layer they write it as ``[bias] + weights`` while the data stays
  ``[weights, bias]``, so the 0.1 lands on the weight from the first input
  unit and the bias's prior mean is 0. We keep one ``mu0``: a prior on one
  input weight has no reason in the model, and a bias-only prior would need a
  per-coordinate mean over vectors whose layout (weights, bias, normalisation
  entries, in the spec's order) differs from model to model. At the defaults
  the difference is small: the 0.1 moves a unit's scores by about 0.1 times
  that coordinate, and an atom's posterior mean of it by ``0.1 / (n + 1)``
  for ``n`` members.
* **The cap is hard**: no new atom once the layer has ``max_width`` units, or
  the widest client's width if that is more. The authors' new-atom block has
  ``min(J, max(700 - L, 1))`` columns, ``L`` the atoms present while a client
  is matched (its own units taken out, in a sweep): never fewer than one, so
  every match made while 700 or more atoms remain may open one more, in the
  first pass and in the sweeps alike: their first pass can end up to
  ``K - 1`` atoms past ``max(700, widest client)``, and each sweep can add
  up to ``K`` more, so sweeps do not bring their layers back under the cap
  (they can take them further past it).
* **Sweeps stop early** once a whole sweep leaves the assignment unchanged
  (the authors always run all of them); atoms are renumbered after every
  sweep in order of first appearance (client 0's units first, in its order),
  which renames atoms but changes no assignment.
* **Any permutation spec.** A unit's vector is every entry of its group that
  is already aligned on its other axes (:func:`alignfl.core.merging.bbp_model.aligned_refs`), as the other
  alignment costs use it (normalisation entries too), except the output
  layer's weights unless ``include_classifier``. With it, the last hidden
  layer's units are also told apart by what they vote for, which the output
  layer's weights (already aligned) say; PFNM includes them too, with their
  precision scaled by each client's class frequencies, where we include them
  as they are.
* ``estimate="weighted"`` is offered beside the posterior mean: the client
  units of an atom averaged with the clients' weights. The posterior mean
  shrinks towards ``mu0`` (K identical clients give ``K/(K+1)`` of the model
  with the defaults); the weighted mean gives back identical clients exactly,
  and a grown layer computes the weighted average of the clients' functions.

Scale: the cost compares squared norms with ``sigma``. With sigma = 1, units
of squared norm well below a few units (PyTorch's initialisation gives about
1/3 per unit) are told apart mostly by the popularity and new-atom terms, so
even identical units may open new atoms; trained or larger weights match on
their values, and small weights are scored on their values too once sigma
and sigma0 are set to their scale (``tests/test_bbp_hand_worked.py`` works out both
cases by hand).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from alignfl.models.permutation import AxisRef
from alignfl.plugins.options import check_fields, choice, is_kind, option, positive

ESTIMATES = ("posterior", "weighted")
"""How a global unit is computed from its members: the authors' posterior mean, or the weighted mean."""
POPULARITY_CAP = 10
"""Member counts above this count as this much in the popularity term (the authors' ``np.minimum(counts, 10)``)."""


@dataclass(frozen=True)
class BBPSettings:
    """BBP-MAP's hyper-parameters, declared once here; the defaults are the FedMA authors'.

    A settings family (:mod:`alignfl.plugins.options`): FedMA's run-config keys
    ``bbp-<field>`` borrow these fields (:class:`alignfl.strategies.fedma.FedMASettings`),
    so their defaults, help and checks are these, and their keys the same
    wherever they are borrowed. ``sigma`` and ``sigma0`` are variances, as in
    the authors' code; ``max_width`` is the hard cap of the module notes.
    """

    key_prefix: ClassVar[str] = "bbp"

    sigma: float = option(
        1.0, "BBP-MAP: variance of a client unit around its global unit", positive, "must be a finite number > 0"
    )
    sigma0: float = option(
        1.0, "BBP-MAP: prior variance of a global unit around bbp-mu0", positive, "must be a finite number > 0"
    )
    mu0: float = option(
        0.0, "BBP-MAP: prior mean of every coordinate of a global unit", math.isfinite, "must be a finite number"
    )
    gamma: float = option(
        7.0,
        "BBP-MAP: Indian-buffet mass (larger opens new global units more readily)",
        positive,
        "must be a finite number > 0",
    )
    max_width: int = option(
        700,
        "BBP-MAP: most units a matched layer may grow to (or its widest client's)",
        lambda v: v >= 1,
        "must be an integer >= 1",
    )
    iterations: int = option(
        5, "BBP-MAP: most sweeps over the clients after the first pass", lambda v: v >= 0, "must be an integer >= 0"
    )
    estimate: str = choice(
        "posterior",
        "BBP-MAP: a global unit from its members: posterior (the authors' "
        "posterior mean) or weighted (the clients' weighted mean)",
        ESTIMATES,
    )
    include_classifier: bool = option(
        False,
        "BBP-MAP: match the last hidden layer's units on their output-layer "
        "weights too, which are already aligned and say what each unit votes for "
        "(PFNM does; FedMA leaves them out)",
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class GroupMatch:
    """One matched group: which atom each client unit went to, and the atoms.

    ``assignments[k][j]`` is the global unit of client ``k``'s unit ``j``;
    ``units`` is ``L x D``, one global unit vector per row (float64), whose
    columns are the entries ``refs`` in order, each ``features`` wide.
    """

    assignments: tuple[Tensor, ...]
    units: Tensor
    refs: tuple[AxisRef, ...] = ()
    features: tuple[int, ...] = ()

    @property
    def width(self) -> int:
        return self.units.shape[0]


# --- the cost and one client's assignment -------------------------------------------------


def extended_cost(
    rows: Tensor, natural: Tensor, counts: Tensor, clients: int, settings: BBPSettings, new_columns: int
) -> Tensor:
    """The ``J x (L + new_columns)`` score of every client unit on every atom, then on new atoms.

    ``rows`` are one client's unit vectors (``J x D``), ``natural`` the atoms'
    ``mu0/sigma0 + sum of y`` (``L x D``) and ``counts`` their member counts,
    both without this client; all in one floating dtype, which the score keeps.
    One matrix product gives every ``<y_l, N_i>``; the rest are row and column
    norms (module notes give the formula).
    """
    obs, prior = 1.0 / settings.sigma, 1.0 / settings.sigma0
    prior_mean, dims = settings.mu0 * prior, rows.shape[1]
    row_norms = torch.linalg.vector_norm(rows, dim=1).square() * obs**2
    atom_norms = torch.linalg.vector_norm(natural, dim=1).square()
    precision = prior + counts * obs
    popular = counts.clamp(max=POPULARITY_CAP)
    existing = (
        (row_norms[:, None] + (2.0 * obs) * (rows @ natural.T) + atom_norms) / (precision + obs)
        - atom_norms / precision
        + torch.log(popular / (clients - popular))
    )
    opened = row_norms + (2.0 * prior_mean * obs) * rows.sum(1) if prior_mean else row_norms
    opened = (
        (opened + dims * prior_mean**2) / (prior + obs)
        - dims * prior_mean**2 / prior
        + 2.0 * math.log(settings.gamma / clients)
    )
    order = torch.arange(1, new_columns + 1, dtype=rows.dtype)
    return torch.cat([existing, opened[:, None] - 2.0 * torch.log(order)], dim=1)


class _Atoms:
    """The atoms' sufficient statistics and every client's assignment, updated one client at a time.

    The statistics live in a buffer sized for the widest the layer can get, so
    opening atoms copies nothing; they are kept in the rows' dtype (float32 for
    float32 models: the matrix product dominates) and the global units are
    recomputed in float64 from the members at the end.
    """

    def __init__(self, rows: Sequence[Tensor], settings: BBPSettings, cap: int) -> None:
        self.rows = rows
        self.settings = settings
        self.cap = cap
        self.prior_mean = settings.mu0 / settings.sigma0
        capacity = min(cap, sum(r.shape[0] for r in rows))
        self._natural = rows[0].new_zeros((capacity, rows[0].shape[1]))
        self._counts = rows[0].new_zeros(capacity)
        self.width = 0
        self.assignments: list[Tensor] = [torch.empty(0, dtype=torch.long) for _ in rows]

    @property
    def natural(self) -> Tensor:
        return self._natural[: self.width]

    @property
    def counts(self) -> Tensor:
        return self._counts[: self.width]

    def remove(self, client: int) -> None:
        """Take ``client``'s units out; atoms left without members are deleted and the rest renumbered."""
        assignment = self.assignments[client]
        self.natural.index_add_(0, assignment, self.rows[client], alpha=-1.0 / self.settings.sigma)
        self.counts.index_add_(0, assignment, self.counts.new_full(assignment.shape, -1.0))
        keep = self.counts > 0.5
        self.assignments[client] = assignment[:0]
        if not bool(keep.all()):
            self._keep(keep, torch.cumsum(keep, 0) - 1)

    def add(self, client: int) -> None:
        """Assign ``client``'s units by the best extended-cost assignment, opening atoms as it says."""
        from scipy.optimize import linear_sum_assignment  # here: scipy.optimize's import costs a ClientApp 0.4 s

        rows, width = self.rows[client], self.width
        if width == 0:
            chosen = torch.arange(rows.shape[0])
        else:
            new_columns = min(rows.shape[0], self.cap - width)
            cost = extended_cost(rows, self.natural, self.counts, len(self.rows), self.settings, new_columns)
            _, columns = linear_sum_assignment(cost.numpy(), maximize=True)
            chosen = torch.from_numpy(columns).long()
        opened = chosen >= width
        chosen[opened] = width + torch.arange(int(opened.sum()))
        self.width = width + int(opened.sum())
        self._natural[width : self.width] = self.prior_mean
        self._counts[width : self.width] = 0.0
        self.natural.index_add_(0, chosen, rows, alpha=1.0 / self.settings.sigma)
        self.counts.index_add_(0, chosen, self.counts.new_ones(chosen.shape))
        self.assignments[client] = chosen

    def renumber(self) -> None:
        """Number atoms by first appearance (client 0's units first), so two sweeps' assignments compare."""
        flat = torch.cat(self.assignments)
        first = torch.full((self.width,), flat.numel(), dtype=torch.long)
        first.scatter_reduce_(0, flat, torch.arange(flat.numel()), reduce="amin")
        order = torch.argsort(first)
        rename = torch.empty(self.width, dtype=torch.long)
        rename[order] = torch.arange(self.width)
        self._keep(order, rename)

    def _keep(self, selection: Tensor, rename: Tensor) -> None:
        """Keep the atoms ``selection`` picks (a mask or an order); ``rename`` maps old atom ids to new ones."""
        natural, counts = self.natural[selection], self.counts[selection]
        self.width = natural.shape[0]
        self.natural.copy_(natural)
        self.counts.copy_(counts)
        self.assignments = [rename[a] for a in self.assignments]

    def units(self, weights: Sequence[float]) -> Tensor:
        """The global unit vectors in float64: posterior means, or the members' weighted means."""
        posterior = self.settings.estimate == "posterior"
        sums = torch.full(
            (self.width, self.rows[0].shape[1]), self.prior_mean if posterior else 0.0, dtype=torch.float64
        )
        totals = torch.full((self.width,), 1.0 / self.settings.sigma0 if posterior else 0.0, dtype=torch.float64)
        for rows, assignment, weight in zip(self.rows, self.assignments, weights):
            scale = 1.0 / self.settings.sigma if posterior else float(weight)
            sums.index_add_(0, assignment, rows.double(), alpha=scale)
            totals.index_add_(0, assignment, totals.new_full(assignment.shape, scale))
        return sums / totals[:, None]


def match_units(
    rows: Sequence[Tensor], weights: Sequence[float], settings: BBPSettings, generator: torch.Generator | int = 0
) -> GroupMatch:
    """BBP-MAP over the unit vectors of K clients (``rows[k]``: ``J_k x D``).

    At most ``max(settings.max_width, widest J_k)`` atoms. Widest client first,
    the others matched in turn, then up to ``settings.iterations`` sweeps over
    the clients in random order (drawn from ``generator``) until a sweep
    changes nothing.
    """
    check_weights(len(rows), weights)
    if any(r.dim() != 2 for r in rows) or len({r.shape[1] for r in rows}) != 1:
        raise ValueError(f"client unit vectors must be J x D matrices with one D, got {[tuple(r.shape) for r in rows]}")
    cap = max(settings.max_width, max(r.shape[0] for r in rows))
    atoms = _Atoms([r if r.dtype == torch.float64 else r.float() for r in rows], settings, cap)
    for client in sorted(range(len(rows)), key=lambda k: -rows[k].shape[0]):
        atoms.add(client)
    atoms.renumber()
    rng = as_generator(generator)
    for _ in range(settings.iterations if len(rows) > 1 else 0):
        before = list(atoms.assignments)
        for client in torch.randperm(len(rows), generator=rng).tolist():
            atoms.remove(client)
            atoms.add(client)
        atoms.renumber()
        if all(torch.equal(old, new) for old, new in zip(before, atoms.assignments)):
            break
    return GroupMatch(tuple(atoms.assignments), atoms.units(weights))


def check_weights(clients: int, weights: Sequence[float]) -> None:
    """Raise ValueError unless there is one finite weight > 0 per client, and at least one client."""
    if clients < 1 or len(weights) != clients:
        raise ValueError(
            f"need one weight per client and at least one client, got {clients} clients and {len(weights)} weights"
        )
    if any(not (math.isfinite(float(w)) and float(w) > 0) for w in weights):
        raise ValueError(f"weights must be finite and > 0, got {list(weights)}")


def as_generator(generator: torch.Generator | int) -> torch.Generator:
    """``generator`` itself, or a new one seeded with it (an integer)."""
    if isinstance(generator, torch.Generator):
        return generator
    if not is_kind(generator, int):
        raise ValueError(f"generator must be a torch.Generator or an integer seed, got {generator!r}")
    return torch.Generator().manual_seed(generator)
