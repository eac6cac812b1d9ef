"""REPAIR: renormalise a merged model's units to the statistics the merged models' units had.

Jordan, Sedghi, Saukh, Entezari and Neyshabur, "REPAIR: REnormalizing Permuted Activations for Interpolation
Repair", ICLR 2023 (arXiv:2211.08403). Averaging models, even perfectly aligned ones, shrinks the spread of each
merged unit's pre-activation (the endpoints' units are not perfectly correlated); REPAIR measures the merged
model's per-unit mean and standard deviation on data and applies, per unit, the affine correction that gives it
the mean and standard deviation the endpoints' units had (their weighted mean), folded into the layer's weights.

REPAIR adapted to federated data. The authors measure every endpoint and the merged model on one shared data set.
In a federation each client holds only its own data and its own model, so here, per unit:

* the target is the examples-weighted mean, over the clients, of each client's mean and of its std of its own
  trained model's unit on its own training data (each client sends these with its model);
* the merged model's statistics are measured by the clients on their own training data after the server sends
  it, and averaged with the same weights: like with like, so a model every client holds is left as it is even
  on non-IID data.

Measuring as the authors do (every endpoint and the merged model on one pooled data set) would need each client
to evaluate every other client's model on its data (K models down to every client, K² forward passes), or the
clients' data in one place. The offline merge tool, which holds every client's data, measures both ways
(:func:`alignfl.fl_app.analysis.merge.repair_merge`, ``--repair-data own|pooled``).

Where a unit is measured (the *site*), the same for every model family: the input of the hidden layer's
position encoding (:class:`alignfl.models.pan.PositionEncoding`, present in every hidden layer whether PANs are on or
off), i.e. the output of the layer that produces the units, after its normalisation if it has one, before the
position encoding and the non-linearity. That layer (the site's *producer*) is found by running the model once
on zeros: the module whose forward pass ended last before the encoding's began (modules that return their input
unchanged, such as ``nn.Identity``, do not count). So: an MLP's hidden ``Linear``; a VGG's conv (its BatchNorm or
GroupNorm where it has one); ResNet's ``bn1``, ``bn2`` (before the residual addition) and conv shortcuts' BN;
MobileNet's norm after every depthwise and pointwise conv; the transformer's ``mlp.fc1``; a Ψ-Net's grouped
norms and grouped linears. The residual stream's sum, attention features and the transformer's stream are not
sites (no non-linearity reads them directly).

How the correction is folded (exact in evaluation mode), ``y`` being a site's pre-activation, ``s`` = target
std / measured std and ``t`` = target mean - ``s`` · measured mean, so that ``y' = s·y + t``:

* ``Linear``/``Conv`` producer: its weight's rows times ``s``, its bias ``s·b + t`` (a layer without bias cannot
  take the shift and is refused);
* ``GroupNorm`` producer (Ψ-Net's grouped norms are one per group): its scale times ``s``, its shift ``s·β + t``;
* ``BatchNorm`` producer: its running statistics, so that training mode (batch statistics: a BatchNorm's output
  there has mean β and std |γ| whatever the weights before it) is unchanged and evaluation mode gets the
  correction; a channel the running statistics cannot carry (``γ = 0``, or a scale that would need a negative
  running variance) takes it in its scale and shift instead.

A unit whose measured std is (numerically) zero keeps its scale and only takes the shift.

Statistics: per unit, the mean and the (population) standard deviation over every example and, for convolutions,
every position, accumulated in float64 chunk by chunk (Chan et al.'s pairwise update), with the model in
evaluation mode. A model's statistics on one client's data are a few KB: two float64 numbers per hidden unit.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from alignfl.models.pan import PositionEncoding
from alignfl.models.permutation import PermutationSpec

REPAIR_RECORD = "repair-stats"
"""The reply ArrayRecord of a model's unit statistics: ``<site>.mean`` and ``<site>.std``, float64, one per unit."""
STATISTICS_CHUNK = 512
"""Examples per forward pass while statistics are taken."""
DEAD_STD = 1e-12
"""A measured std at most this (times the unit's scale of values) is a dead unit: it keeps its scale."""

_AFFINE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.GroupNorm)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class RepairError(ValueError):
    """A model whose units REPAIR cannot find or rescale; the message names the layer."""


@dataclass(frozen=True)
class Piece:
    """A producing layer (or, for a grouped layer, one group of it): its module path, the permutation group of
    its output units, and whether its running statistics take the correction (a BatchNorm, with its ``eps``)."""

    prefix: str
    group: str
    batchnorm: bool = False
    eps: float = 0.0

    @property
    def weight(self) -> str:
        return f"{self.prefix}.weight"

    def width(self, shapes: Mapping[str, Sequence[int]]) -> int:
        """The piece's number of units in a model whose entries have ``shapes``."""
        return int(shapes[self.weight][0])


@dataclass(frozen=True)
class Site:
    """One hidden layer's units as REPAIR measures and rescales them: named by its producer's module path,
    measured at the input of the module ``probe``, produced by ``pieces`` (one, or one per group of a grouped
    layer, their units concatenated in order)."""

    name: str
    probe: str
    pieces: tuple[Piece, ...]

    def widths(self, shapes: Mapping[str, Sequence[int]]) -> list[int]:
        return [piece.width(shapes) for piece in self.pieces]


# --- finding the sites --------------------------------------------------------------------------------------


def _producers(model: nn.Module, input_shape: Sequence[int], probes: Mapping[str, nn.Module]) -> dict[str, str]:
    """Probe name → the module whose forward pass ended last before the probe's began (forward order)."""
    names = {module: name for name, module in model.named_modules()}
    last: list[str] = [""]
    found: dict[str, str] = {}

    def ended(module: nn.Module, inputs: tuple, output: object) -> None:
        if not (len(inputs) == 1 and output is inputs[0]):  # a pass-through (nn.Identity) produces nothing
            last[0] = names[module]

    def starts(module: nn.Module, inputs: tuple) -> None:
        found[names[module]] = last[0]

    handles = [
        module.register_forward_hook(ended) for name, module in model.named_modules() if name and name not in probes
    ]
    handles += [probe.register_forward_pre_hook(starts) for probe in probes.values()]
    parameter = next(model.parameters())
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros((2, *input_shape), dtype=parameter.dtype, device=parameter.device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    return found


def _piece(prefix: str, module: nn.Module, groups: Mapping[str, str]) -> Piece:
    """The piece of a producing leaf layer, or why REPAIR cannot rescale its units."""
    kind = type(module).__name__
    group = groups.get(f"{prefix}.weight")
    if group is None:
        raise RepairError(f"the units of layer '{prefix}' ({kind}) are in no permutation group")
    if isinstance(module, _BATCH_NORMS):
        if not (module.affine and module.track_running_stats):
            raise RepairError(f"layer '{prefix}' ({kind}) needs an affine scale and running statistics")
        return Piece(prefix, group, batchnorm=True, eps=float(module.eps))
    if isinstance(module, _AFFINE_LAYERS):
        if getattr(module, "bias", None) is None:
            raise RepairError(f"layer '{prefix}' ({kind} without bias) cannot take REPAIR's shift")
        return Piece(prefix, group)
    raise RepairError(f"layer '{prefix}' ({kind}) produces hidden units REPAIR cannot rescale")


def _pieces(prefix: str, module: nn.Module, groups: Mapping[str, str]) -> tuple[Piece, ...]:
    """A producer's pieces: itself, or its leaf layers in order (a grouped layer's per-group modules)."""
    leaves = [(name, leaf) for name, leaf in module.named_modules() if not list(leaf.children())]
    return tuple(_piece(f"{prefix}.{name}" if name else prefix, leaf, groups) for name, leaf in leaves)


def find_sites(model: nn.Module, input_shape: Sequence[int], spec: PermutationSpec) -> tuple[Site, ...]:
    """The model's sites in forward order (module notes); raises :class:`RepairError` naming the layer whose units
    cannot be rescaled, or when the model has no position-encoding site at all."""
    probes = {name: module for name, module in model.named_modules() if isinstance(module, PositionEncoding)}
    if not probes:
        raise RepairError(f"{type(model).__name__} has no hidden layer REPAIR can find (no position-encoding site)")
    groups = {ref.key: name for name, refs in spec.groups.items() for ref in refs if ref.axis == 0}
    producers = _producers(model, input_shape, probes)
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    sites = []
    for probe, producer in producers.items():
        if not producer:
            raise RepairError(f"nothing produces the units that '{probe}' encodes")
        site = Site(producer, probe, _pieces(producer, model.get_submodule(producer), groups))
        units = probes[probe].encoding.numel()
        if sum(site.widths(shapes)) != units:
            raise RepairError(
                f"layer '{producer}' has {sum(site.widths(shapes))} output units, but '{probe}' encodes {units}"
            )
        sites.append(site)
    return tuple(sites)


_SITES: weakref.WeakKeyDictionary[nn.Module, tuple[Site, ...]] = weakref.WeakKeyDictionary()


def sites_of(model: nn.Module, input_shape: Sequence[int]) -> tuple[Site, ...]:
    """:func:`find_sites` of a model that describes its permutation symmetry, once per model object (a client
    process reuses its model for every message; the sites do not depend on the widths)."""
    if model not in _SITES:
        _SITES[model] = find_sites(model, input_shape, model.permutation_spec())
    return _SITES[model]


# --- statistics -----------------------------------------------------------------------------------------------


class _Moments:
    """Running count, mean and sum of squared deviations per unit (float64)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None

    def add(self, h: Tensor) -> None:
        values = h.detach().transpose(0, 1).reshape(h.shape[1], -1).double()
        count = values.shape[1]
        mean = values.mean(dim=1)
        m2 = ((values - mean[:, None]) ** 2).sum(dim=1)
        if self.mean is None or self.m2 is None:
            self.count, self.mean, self.m2 = count, mean, m2
            return
        total = self.count + count
        delta = mean - self.mean
        self.mean = self.mean + delta * (count / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * count / total)
        self.count = total


class _Measured(Exception):
    """Raised at the last site a forward pass measures: the layers after it need not run."""


@torch.no_grad()
def unit_statistics(
    model: nn.Module, sites: Sequence[Site], x: Tensor, device: torch.device, chunk: int = STATISTICS_CHUNK
) -> dict[str, Tensor]:
    """Per site, the mean and std of every unit's pre-activation over ``x`` (module notes), as the
    :data:`REPAIR_RECORD` entries ``<site>.mean`` and ``<site>.std`` (float64, on the CPU). ``sites`` in forward
    order: each forward pass stops at the last one."""
    moments = {site.name: _Moments() for site in sites}

    def measure(moment: _Moments, last: bool) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, inputs: tuple) -> None:
            moment.add(inputs[0])
            if last:
                raise _Measured

        return hook

    handles = [
        model.get_submodule(site.probe).register_forward_pre_hook(measure(moments[site.name], i == len(sites) - 1))
        for i, site in enumerate(sites)
    ]
    training = model.training
    try:
        model.eval()
        for start in range(0, len(x), chunk):
            try:
                model(x[start : start + chunk].to(device, non_blocking=True))
            except _Measured:
                pass
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    statistics = {}
    for name, moment in moments.items():
        if moment.mean is None or moment.m2 is None:
            raise ValueError(f"no data reached site '{name}'")
        statistics[f"{name}.mean"] = moment.mean.cpu()
        statistics[f"{name}.std"] = (moment.m2 / moment.count).clamp(min=0).sqrt().cpu()
    return statistics


def statistics_shapes(sites: Sequence[Site], shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int]]:
    """The :data:`REPAIR_RECORD` entries and their shapes for a model whose entries have ``shapes``."""
    expected: dict[str, tuple[int]] = {}
    for site in sites:
        units = sum(site.widths(shapes))
        expected[f"{site.name}.mean"] = (units,)
        expected[f"{site.name}.std"] = (units,)
    return expected


def statistics_problem(statistics: Mapping[str, Tensor], expected: Mapping[str, tuple[int]]) -> str | None:
    """What is wrong with a record of unit statistics, or None: the expected entries and shapes, finite values,
    no negative std."""
    missing, extra = sorted(set(expected) - set(statistics)), sorted(set(statistics) - set(expected))
    if missing or extra:
        return f"'{REPAIR_RECORD}' entries differ: missing {missing[:5]}, unexpected {extra[:5]}"
    for key, shape in expected.items():
        values = statistics[key]
        if tuple(values.shape) != shape:
            return f"'{REPAIR_RECORD}' entry '{key}' has shape {tuple(values.shape)}, expected {shape}"
        if not torch.isfinite(values).all():
            return f"'{REPAIR_RECORD}' entry '{key}' holds NaN or infinite values"
        if key.endswith(".std") and (values < 0).any():
            return f"'{REPAIR_RECORD}' entry '{key}' holds a negative standard deviation"
    return None


# --- statistics on the merged model's units ----------------------------------------------------------------------


@dataclass(frozen=True)
class UnitStats:
    """One model's statistics of one site's units on one client's data, in the merged model's unit order, and
    which merged units they cover (a client's model may lack some: a narrower sub-model, an untrained group)."""

    mean: Tensor
    std: Tensor
    held: Tensor

    @classmethod
    def whole(cls, mean: Tensor, std: Tensor) -> UnitStats:
        return cls(mean.double(), std.double(), torch.ones(len(mean), dtype=torch.bool))


def _carried(values: Tensor, unit_map: Tensor | None, width: int) -> tuple[Tensor, Tensor]:
    """``values`` of a client's units on ``width`` merged units, and which merged units they reach. ``unit_map``:
    None (unit ``i`` stays unit ``i``: the first units), a permutation (merged unit ``i`` is the client's unit
    ``map[i]``) or a coupling (client units × merged units: merged unit ``i`` takes the coupling-weighted mean of
    the client's units, exact for a permutation coupling)."""
    if unit_map is None:
        carried = torch.zeros(width, dtype=torch.float64)
        reached = torch.zeros(width, dtype=torch.bool)
        carried[: len(values)], reached[: len(values)] = values[:width], True
        return carried, reached
    if unit_map.dim() == 1:
        return values[unit_map.long()], torch.ones(width, dtype=torch.bool)
    coupling = unit_map.double()
    mass = coupling.sum(dim=0)
    reached = mass > 0
    return (values @ coupling) / mass.where(reached, torch.ones_like(mass)), reached


def assignment_coupling(assignment: Tensor, width: int) -> Tensor:
    """A matching that may open units (BBP-MAP: a client's unit ``j`` joins merged unit ``assignment[j]`` among
    ``width``) as a units × ``width`` coupling for :func:`carry_statistics`."""
    coupling = torch.zeros(len(assignment), width, dtype=torch.float64)
    coupling[torch.arange(len(assignment)), assignment.long()] = 1.0
    return coupling


def carry_statistics(
    statistics: Mapping[str, Tensor],
    sites: Sequence[Site],
    client_shapes: Mapping[str, Sequence[int]],
    merged_shapes: Mapping[str, Sequence[int]],
    unit_maps: Mapping[str, Tensor] | None = None,
    held_pieces: set[str] | None = None,
) -> dict[str, UnitStats]:
    """A client's unit statistics (in its own units, ``client_shapes``) carried onto the merged model's units
    (``merged_shapes``) by ``unit_maps`` (permutation group → map, see :func:`_carried`; a group without one keeps
    its order). ``held_pieces``: the pieces (module paths) whose units the client's reply holds (None: all)."""
    carried: dict[str, UnitStats] = {}
    maps = unit_maps or {}
    for site in sites:
        own = torch.split(statistics[f"{site.name}.mean"].double(), site.widths(client_shapes))
        spread = torch.split(statistics[f"{site.name}.std"].double(), site.widths(client_shapes))
        means, stds, helds = [], [], []
        for piece, mean, std in zip(site.pieces, own, spread, strict=True):
            width = piece.width(merged_shapes)
            mean_on, reached = _carried(mean, maps.get(piece.group), width)
            std_on, _ = _carried(std, maps.get(piece.group), width)
            held = reached if held_pieces is None or piece.prefix in held_pieces else torch.zeros_like(reached)
            means.append(mean_on)
            stds.append(std_on)
            helds.append(held)
        carried[site.name] = UnitStats(torch.cat(means), torch.cat(stds), torch.cat(helds))
    return carried


def averaged(clients: Sequence[UnitStats], weights: Sequence[float]) -> UnitStats:
    """One site's statistics over several clients, as REPAIR interpolates its endpoints' (each measured here on its
    client's data, module notes): per unit, the weighted mean of the clients' means and the weighted mean of their
    stds (each client weighted by its example count), over the clients that hold the unit."""
    weight = torch.stack(
        [torch.where(c.held, torch.tensor(float(w), dtype=torch.float64), 0.0) for c, w in zip(clients, weights)]
    )
    total = weight.sum(dim=0)
    held = total > 0
    share = weight / total.where(held, torch.ones_like(total))
    mean = (share * torch.stack([c.mean for c in clients])).sum(dim=0)
    std = (share * torch.stack([c.std for c in clients])).sum(dim=0)
    return UnitStats(mean, std, held)


@dataclass(frozen=True)
class Correction:
    """Per unit of a site: ``y' = scale·y + shift``, and which units REPAIR changed (those some client holds)."""

    scale: Tensor
    shift: Tensor
    changed: Tensor
    std_change: Tensor
    """|target std - measured std| of every changed unit: how much REPAIR moved its spread."""


def correction(target: UnitStats, measured: UnitStats) -> Correction:
    """The affine map that gives the measured units the target mean and std (module notes; dead units keep
    their scale)."""
    changed = target.held & measured.held
    floor = DEAD_STD * torch.maximum(measured.mean.abs(), torch.ones_like(measured.mean))
    alive = changed & (measured.std > floor)
    scale = torch.where(alive, target.std / measured.std.where(alive, torch.ones_like(measured.std)), 1.0)
    shift = torch.where(changed, target.mean - scale * measured.mean, 0.0)
    return Correction(scale, shift, changed, (scale * measured.std - measured.std).abs()[changed])


# --- folding the correction into the model -------------------------------------------------------------------------


def _kept(old: Tensor, new: Tensor, same: Tensor) -> Tensor:
    """``new`` in ``old``'s dtype, but ``old``'s values bit for bit on the units REPAIR leaves as they are."""
    return torch.where(same.reshape((-1,) + (1,) * (old.dim() - 1)), old, new.to(old.dtype))


def _fold_affine(state: dict[str, Tensor], piece: Piece, scale: Tensor, shift: Tensor) -> None:
    weight, bias = state[piece.weight], state[f"{piece.prefix}.bias"]
    same = (scale == 1) & (shift == 0)
    shape = (-1,) + (1,) * (weight.dim() - 1)
    state[piece.weight] = _kept(weight, weight.double() * scale.reshape(shape), same)
    state[f"{piece.prefix}.bias"] = _kept(bias, bias.double() * scale + shift, same)


def _fold_batchnorm(state: dict[str, Tensor], piece: Piece, scale: Tensor, shift: Tensor) -> None:
    """Into the running statistics where they can carry it, else into the scale and shift (module notes)."""
    keys = {name: f"{piece.prefix}.{name}" for name in ("weight", "bias", "running_mean", "running_var")}
    gamma, beta, mean, var = (state[key].double() for key in keys.values())
    slope = gamma / (var + piece.eps).sqrt()  # evaluation mode: y = slope·x + offset
    offset = beta - slope * mean
    new_var = (var + piece.eps) / scale**2 - piece.eps
    usable = (gamma != 0) & (new_var >= 0)
    new_slope = (scale * slope).where(usable, torch.ones_like(slope))
    new_mean = (beta - (scale * offset + shift)) / new_slope
    folded = {
        "running_mean": mean.where(~usable, new_mean),
        "running_var": var.where(~usable, new_var),
        "weight": gamma.where(usable, scale * gamma),
        "bias": beta.where(usable, scale * beta + shift),
    }
    same = (scale == 1) & (shift == 0)
    for name, key in keys.items():
        state[key] = _kept(state[key], folded[name], same)


def fold_corrections(
    state: Mapping[str, Tensor], sites: Sequence[Site], corrections: Mapping[str, Correction]
) -> dict[str, Tensor]:
    """A copy of ``state`` whose sites in ``corrections`` produce ``scale·y + shift`` where they produced ``y``."""
    folded = dict(state)
    shapes = {key: tuple(value.shape) for key, value in state.items()}
    for site in sites:
        if site.name not in corrections:
            continue
        fix = corrections[site.name]
        widths = site.widths(shapes)
        for piece, scale, shift in zip(
            site.pieces, torch.split(fix.scale, widths), torch.split(fix.shift, widths), strict=True
        ):
            (_fold_batchnorm if piece.batchnorm else _fold_affine)(folded, piece, scale, shift)
    return folded


def repair_site(
    state: Mapping[str, Tensor],
    site: Site,
    targets: Sequence[UnitStats],
    measured: Sequence[UnitStats],
    weights: Sequence[float],
) -> tuple[dict[str, Tensor], Correction]:
    """One layer's REPAIR: ``state`` whose ``site`` gives every unit the averaged statistics (:func:`averaged`) of the
    clients' own units (``targets``, carried onto the merged units) where the model measured ``measured`` (the
    same clients, on the same data, in the same order), clients weighted by ``weights`` (their example counts).
    Each client's measurement counts for the units its own statistics cover: like with like."""
    on_own = [UnitStats(m.mean, m.std, t.held) for m, t in zip(measured, targets, strict=True)]
    fix = correction(averaged(targets, weights), averaged(on_own, weights))
    return fold_corrections(state, [site], {site.name: fix}), fix


def repair_in_order(
    merged: Mapping[str, Tensor],
    sites: Sequence[Site],
    targets: Sequence[Mapping[str, UnitStats]],
    weights: Sequence[float],
    measure: Callable[[Mapping[str, Tensor], Site], Sequence[UnitStats]],
) -> tuple[dict[str, Tensor], dict[str, Correction]]:
    """REPAIR of every site of ``merged`` in order from the input (:func:`repair_site`), each measured
    (``measure(state, site)``: per client, the model's statistics of the site on its data) after the sites before
    it are corrected, as the authors measure a layer behind the layers already reset. Returns the repaired state
    and each site's correction."""
    state, corrections = dict(merged), {}
    for site in sites:
        measured = measure(state, site)
        state, corrections[site.name] = repair_site(state, site, [t[site.name] for t in targets], measured, weights)
    return state, corrections
