"""Optimal-transport fusion: carry one model's hidden units onto a reference's by a transport map, soft or exact,
also between different widths, then average.

Singh & Jaggi, "Model Fusion via Optimal Transport", NeurIPS 2020 (arXiv:1910.05653), in its weight-based
form (no data on the server). For every permutation group of the model's
:class:`~alignfl.models.permutation.PermutationSpec`, in spec order (input side first):

1. the other model's rows of the group's *own* entries (incoming weights, bias, normalisation entries: the
   axes that are not a later layer's weights *from* the unit) are taken with the maps of the groups already
   solved applied to their other axes, so every cost compares already aligned vectors;
2. the ground cost between those rows and the reference's (euclidean, squared or not, or cosine; optionally
   on unit-norm rows and normalised, :class:`OTSettings`);
3. the marginals: uniform over units, or a unit's importance (the l1 or l2 norm of its row);
4. the transport map ``T`` (``n_other x n_reference``): exact (POT's ``ot.emd``) or entropic Sinkhorn
   (``ot.bregman.sinkhorn`` with ``reg``); POT is the library the authors use.

The aligned model is the other model with every group axis carried by its map: new unit ``j`` of a
group's own entries is ``sum_i T[i, j] old_i / beta_j`` (``beta`` the map's column sums, the authors'
``--correction`` with ``--proper-marginals``: every reference unit a weighted mean of the other's units);
the weights of a later layer *from* the group's units are carried by the same map, see ``split_outgoing``.
Exact OT with uniform marginals between equal widths is a permutation, so fusion then equals one-to-one
matching followed by averaging. Averaging the aligned models, weighted, gives the fused model
(:func:`ot_fuse`); with two models and weights ``(1 - s, s)`` it is the authors' ``ensemble_step = s``.

Defaults are the authors' published weight-based recipe (their README's VGG11 fusion: ``--exact
--correction --ground-metric euclidean --not-squared --ground-metric-normalize none --normalize-wts
--past-correction``), not their argument parser's bare defaults: without ``--correction`` a map's entries
are ``1/n``, so every fused layer is shrunk by the width, and without ``--past-correction`` a fused layer
takes its inputs in the other model's order while the layer before it is in the reference's. Both stay
keys (``correction``, ``past_correction``) to reproduce the parser's behaviour; ``reg`` (0.01),
``marginals`` (uniform) and the metric follow the parser.

Where this differs from the authors' code (``sidak/otfusion``, ``wasserstein_ensemble.py``):

* **Any permutation spec.** Their code walks the parameters in order and assumes a plain chain of fully
  connected or convolutional layers without biases; here every model with a permutation description
  works (MLPs, VGG, ResNet residual streams, Psi-Net groups, the transformer's stream and heads), a
  group's rows being all its own entries (a bias and BatchNorm entries join the incoming weights, and
  are carried with the unit).
* **The output layer.** Their weight mode also solves a map for the classifier's outputs (or averages it
  plainly with ``--skip-last-layer``); classes are never permuted here (the spec has no group for them),
  which equals their result whenever their last map is the identity and never lets class ``a``'s unit
  be averaged into class ``b``.
* **split_outgoing** (default on). Their code carries a later layer's weights from a unit by the same
  column-normalised map, which at different widths scales that layer's inputs by ``n_other /
  n_reference`` (a unit copied onto two reference units keeps its whole outgoing weight twice). Here
  the outgoing weights use the map divided by its *row* sums, so a unit spread over several units
  splits its outgoing weight among them, and units merged into one add theirs: fusing a model into
  another width keeps its function where units split or merge exactly. Between equal widths with uniform
  marginals both are the same; ``split_outgoing=false`` is their code.
* Activation-based costs and marginals (``--geom-ensemble-type acts``) need data on the server and are
  not offered; nor are Gromov-Wasserstein, unbalanced OT (their weight mode calls the balanced solvers
  anyway) or the cost clipping (``--clip-gm``, off by default).
* **The guard against a map's empty column** is a floor under the column's mass (1e-9), where their code adds
  the constant to every mass: a permutation map then carries every unit exactly, so fusion that moves no unit
  is FedAvg to the last bit. Adding it scaled each unit of a layer wider than ~60 by one float32 ulp, which
  long local training grew into points of accuracy between otherwise equal runs; the maps differ by at most
  ``1e-9 / mass`` relative.
* ``ot.emd`` runs with ``numItermax`` 10**7 rather than POT's 10**5 so that wide layers (1024 units) reach
  the optimum instead of stopping early with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from alignfl.core.merging.alignment import weighted_average
from alignfl.models.permutation import AxisRef, PermutationSpec, unit_view
from alignfl.plugins.options import check_fields, choice, option, positive

StateDict = Mapping[str, Tensor]
GROUND_METRICS = ("euclidean", "cosine")
COST_NORMALISATIONS = ("none", "log", "max", "median", "mean")
MARGINALS = ("uniform", "l1", "l2")
EMD_MAX_ITERATIONS = 10_000_000
_EPS = 1e-9


@dataclass(frozen=True)
class OTSettings:
    """OT fusion's settings, declared once here (module notes: defaults and where they come from).

    ``otfusion``'s run-config keys ``otfusion-<field>`` and the merge tool's ``--otfusion-<field>`` borrow
    these fields, so their defaults, help and checks are these.
    """

    exact: bool = option(True, "exact OT (POT's emd; a permutation between equal widths); false: Sinkhorn")
    reg: float = option(0.01, "Sinkhorn's entropic regularisation (when not exact)", positive, "must be > 0")
    ground_metric: str = choice(
        "euclidean",
        "cost between two units' aligned incoming weights",
        GROUND_METRICS,
    )
    squared: bool = option(False, "square the euclidean cost (the authors' recipe: not squared)")
    normalize_cost: str = choice(
        "none",
        "normalise the cost matrix: none, log (log1p), or divide by its max, median or mean",
        COST_NORMALISATIONS,
    )
    normalize_weights: bool = option(True, "compare units' weight vectors scaled to unit norm")
    marginals: str = choice(
        "uniform",
        "mass of a unit: uniform, or its importance (l1 or l2 norm of its incoming weights)",
        MARGINALS,
    )
    correction: bool = option(True, "divide the map by its column sums: each reference unit a mean of units")
    past_correction: bool = option(True, "fused layers take their inputs through the previous layer's map")
    split_outgoing: bool = option(
        True, "a later layer's weights from a unit are split over the units it is carried to (false: authors')"
    )

    def __post_init__(self) -> None:
        check_fields(self)


def is_own_axis(ref: AxisRef, tensor: Tensor) -> bool:
    """Whether ``ref`` indexes the unit's own parameters (a layer's outputs, a bias, a norm or embedding
    entry) rather than a later layer's weights *from* the unit (input axes of a weight matrix or kernel)."""
    return not (ref.key.endswith("weight") and tensor.dim() >= 2 and ref.axis >= 1)


def carry_axis(tensor: Tensor, ref: AxisRef, transport: Tensor) -> Tensor:
    """``tensor`` with the units of ``ref`` replaced by ``sum_i transport[i, j] unit_i`` (new unit ``j``)."""
    shape = tensor.shape
    units = shape[ref.axis] // ref.block
    if transport.shape[0] != units:
        raise ValueError(f"a map for {units} units cannot carry '{ref.key}' (its map has {transport.shape[0]} rows)")
    split = tensor.reshape(shape[: ref.axis] + (units, ref.block) + shape[ref.axis + 1 :]).movedim(ref.axis, -1)
    carried = (split @ transport.to(split.dtype)).movedim(-1, ref.axis)
    return carried.reshape(shape[: ref.axis] + (transport.shape[1] * ref.block,) + shape[ref.axis + 1 :])


@dataclass(frozen=True)
class Transport:
    """The couplings that carry one model's units onto a reference's, one per group (``n_other x
    n_reference``, mass summing to 1), and how they are applied (:class:`OTSettings`)."""

    couplings: dict[str, Tensor]
    settings: OTSettings

    def own(self, group: str) -> Tensor:
        """The map for a group's own entries: column-normalised with ``correction``, raw otherwise."""
        coupling = self.couplings[group]
        return coupling / coupling.sum(0, keepdim=True).clamp_min(_EPS) if self.settings.correction else coupling

    def outgoing(self, group: str) -> Tensor:
        """The map for a later layer's weights from the group's units (module notes, ``split_outgoing``)."""
        coupling = self.couplings[group]
        if self.settings.correction and self.settings.split_outgoing:
            return coupling / coupling.sum(1, keepdim=True).clamp_min(_EPS)
        return self.own(group)

    def carry(
        self, key: str, tensor: Tensor, axes: Sequence[tuple[str, AxisRef]], skip: AxisRef | None = None
    ) -> Tensor:
        """``tensor`` (entry ``key``) carried along every axis in ``axes`` whose group has a map, but ``skip``."""
        out = tensor
        for name, ref in axes:
            if name in self.couplings and ref != skip:
                out = carry_axis(out, ref, self.own(name) if is_own_axis(ref, tensor) else self.outgoing(name))
        return out

    def off_diagonal(self) -> dict[str, float]:
        """Per group of equal widths, the share of mass off the diagonal (0: every unit kept its place; the
        authors log the trace ratio, one minus this)."""
        return {
            name: max(0.0, float(1 - coupling.trace() / coupling.sum()))
            for name, coupling in self.couplings.items()
            if coupling.shape[0] == coupling.shape[1]
        }


def as_permutations(transport: Transport) -> dict[str, Tensor]:
    """Per group, the other model's unit carrying most mass onto each reference unit: the permutation when
    the map is one (spec convention: new unit ``j`` is old unit ``perm[j]``)."""
    return {name: coupling.argmax(0) for name, coupling in transport.couplings.items()}


def check_fusable(reference: StateDict, other: StateDict, spec: PermutationSpec) -> None:
    """Raise ValueError unless both states have the same keys and differ in shape only along group axes."""
    missing, extra = sorted(set(reference) - set(other)), sorted(set(other) - set(reference))
    if missing or extra:
        raise ValueError(f"state dicts differ in keys: missing {missing[:5]}, unexpected {extra[:5]}")
    grouped = {(ref.key, ref.axis) for refs in spec.groups.values() for ref in refs}
    for key, tensor in reference.items():
        theirs = other[key].shape
        if len(theirs) != tensor.dim() or any(
            a != b and (key, axis) not in grouped for axis, (a, b) in enumerate(zip(tensor.shape, theirs))
        ):
            raise ValueError(
                f"state entry {key!r} has shape {tuple(theirs)}, {tuple(tensor.shape)} in the reference: "
                "only the widths of permutation groups may differ"
            )
    spec.group_sizes(reference), spec.group_sizes(other)


def _unit_rows(rows: list[Tensor]) -> Tensor:
    return torch.cat([r.double() for r in rows], dim=1)


def ground_cost(other_rows: Tensor, reference_rows: Tensor, settings: OTSettings) -> Tensor:
    """The ``n_other x n_reference`` cost matrix between two sets of unit rows (float64)."""
    if settings.normalize_weights:
        other_rows = other_rows / (other_rows.norm(dim=1, keepdim=True) + _EPS)
        reference_rows = reference_rows / (reference_rows.norm(dim=1, keepdim=True) + _EPS)
    if settings.ground_metric == "cosine":
        norms = other_rows.norm(dim=1, keepdim=True) @ reference_rows.norm(dim=1, keepdim=True).T
        cost = (1 - other_rows @ reference_rows.T / (norms + _EPS)).clamp(min=0)
    else:
        squared = (
            other_rows.square().sum(1, keepdim=True)
            + reference_rows.square().sum(1)
            - 2 * other_rows @ reference_rows.T
        ).clamp(min=0)
        cost = squared if settings.squared else squared.sqrt()
    if settings.normalize_cost == "log":
        return cost.log1p()
    if settings.normalize_cost != "none":
        scale = {"max": cost.max, "median": cost.median, "mean": cost.mean}[settings.normalize_cost]()
        return cost / (scale + _EPS)
    return cost


def marginal(rows: Tensor, kind: str) -> Tensor:
    """A unit's mass: uniform, or its row's l1 / l2 norm (plus a tiny constant), normalised to sum to 1."""
    if kind == "uniform":
        return torch.full((rows.shape[0],), 1.0 / rows.shape[0], dtype=torch.float64)
    mass = rows.double().norm(p=1 if kind == "l1" else 2, dim=1) + _EPS
    return mass / mass.sum()


def solve(mu: Tensor, nu: Tensor, cost: Tensor, settings: OTSettings) -> Tensor:
    """The coupling between ``mu`` and ``nu`` for ``cost``: POT's exact solver or its Sinkhorn."""
    import ot  # here: POT's import costs every process that never fuses about 0.5 s

    a, b, m = mu.numpy(), nu.numpy(), cost.contiguous().numpy()
    if settings.exact:
        plan = ot.emd(a, b, m, numItermax=EMD_MAX_ITERATIONS)
    else:
        plan = ot.bregman.sinkhorn(a, b, m, reg=settings.reg)
    coupling = torch.from_numpy(plan).double()
    if not torch.isfinite(coupling).all() or coupling.sum() <= 0:
        raise ValueError(
            f"Sinkhorn with otfusion-reg={settings.reg} gave no finite transport map (the cost matrix's "
            f"largest entry is {float(cost.max()):.3g}): use a larger otfusion-reg, otfusion-normalize-cost=log "
            "or otfusion-normalize-weights"
        )
    return coupling


def transport_maps(reference: StateDict, other: StateDict, spec: PermutationSpec, settings: OTSettings) -> Transport:
    """The maps that carry ``other``'s units onto ``reference``'s, group by group in spec order (module notes)."""
    check_fusable(reference, other, spec)
    axes = spec.axes_by_key()
    transport = Transport({}, settings)
    for group, refs in spec.groups.items():
        own = [
            ref
            for ref in refs
            if is_own_axis(ref, other[ref.key])
            and all(name in transport.couplings for name, axis in axes[ref.key] if axis != ref)
        ]
        if not own:  # no evidence: keep the order between equal widths, spread the mass otherwise
            n_other, n_reference = spec.group_sizes(other)[group], spec.group_sizes(reference)[group]
            if n_other == n_reference:
                transport.couplings[group] = torch.eye(n_other, dtype=torch.float64) / n_other
            else:
                transport.couplings[group] = torch.full((n_other, n_reference), 1 / (n_other * n_reference)).double()
            continue
        other_rows = _unit_rows([unit_view(transport.carry(r.key, other[r.key], axes[r.key], skip=r), r) for r in own])
        reference_rows = _unit_rows([unit_view(reference[r.key], r) for r in own])
        raw_rows = _unit_rows([unit_view(other[r.key], r) for r in own])
        mu, nu = marginal(raw_rows, settings.marginals), marginal(reference_rows, settings.marginals)
        transport.couplings[group] = solve(mu, nu, ground_cost(other_rows, reference_rows, settings), settings)
    return transport


def carry_state(other: StateDict, spec: PermutationSpec, transport: Transport) -> dict[str, Tensor]:
    """``other`` carried onto the reference's units and widths by ``transport`` (integer entries unchanged).

    Without ``past_correction`` an entry is carried along its own axes only (the authors' code without
    ``--past-correction``), which needs equal widths.
    """
    axes = spec.axes_by_key()
    carried: dict[str, Tensor] = {}
    for key, tensor in other.items():
        entry_axes = axes.get(key, ())
        if not transport.settings.past_correction:
            entry_axes = [(name, ref) for name, ref in entry_axes if is_own_axis(ref, tensor)]
        out = transport.carry(key, tensor, entry_axes) if torch.is_floating_point(tensor) else tensor
        carried[key] = out.clone() if out is tensor else out
    return carried


def align_onto(
    reference: StateDict, other: StateDict, spec: PermutationSpec, settings: OTSettings
) -> tuple[dict[str, Tensor], Transport]:
    """``other`` with its units carried onto ``reference``'s (at the reference's widths), and the maps."""
    transport = transport_maps(reference, other, spec, settings)
    if not settings.past_correction and transport_widths_differ(transport):
        raise ValueError(
            "otfusion-past-correction=false needs equal widths: a layer's inputs would keep the other width"
        )
    return carry_state(other, spec, transport), transport


def transport_widths_differ(transport: Transport) -> bool:
    return any(c.shape[0] != c.shape[1] for c in transport.couplings.values())


def ot_fuse(
    reference: StateDict,
    states: Sequence[StateDict],
    weights: Sequence[float],
    spec: PermutationSpec,
    settings: OTSettings,
) -> tuple[dict[str, Tensor], list[Transport]]:
    """Carry every state onto ``reference`` (:func:`align_onto`), then average them weighted by ``weights``;
    the fused model has the reference's widths. Returns it and every state's maps."""
    aligned, maps = [], []
    for state in states:
        carried, transport = align_onto(reference, state, spec, settings)
        aligned.append(carried)
        maps.append(transport)
    return weighted_average(aligned, weights), maps
