"""One-shot merging: train K models on non-IID splits, then compare ways of merging them into one.

Each of ``--clients`` models trains ``--epochs`` of the project's local SGD
(:class:`alignfl.strategies.base.LocalUpdate`) on its own partition of the dataset's
training split (``--partitioner``, Dirichlet by default) less its local test
split, exactly as round 1 of a federated run trains it, starting from the
server's initial model (``--init same``) or from the client's own
initialisation (``--init different``: ``client-init=independent``). The
merges ``average``, ``matched-<cost>`` and ``matched-ot`` are those of the
``fedavg``, ``matched`` and ``otfusion`` strategies, whose ``aggregate`` gets
the trained models as round 1 of a run gets the replies (:func:`strategy_merge`),
so a one-shot run (``num-server-rounds=1``, ``client-init=independent``) with the
same settings gives the same merged model. Then, on the dataset's test split,
it reports the accuracy of

* every client model on its own;
* ``average``: the coordinate-wise average, weighted by example counts (one-shot FedAvg);
* ``matched-<cost>``: every model aligned onto client 0 with that cost (see
  :mod:`alignfl.core.merging.alignment`), then averaged the same way; with
  ``--match-iterations N`` the models are aligned again onto the matched mean,
  ``N`` passes in all;
* ``matched-bbp``: FedMA's BBP-MAP matching of every layer in turn
  (:mod:`alignfl.core.merging.bbp`, the authors' defaults), which may open new global units:
  the merged model can be wider than the clients' (its width per layer is
  reported); the output layer is averaged per class with the clients' class
  counts, as FedMA does;
* ``matched-ot``: every model carried onto the reference model by optimal
  transport (:mod:`alignfl.core.merging.ot_fusion`: Singh & Jaggi, "Model Fusion via Optimal
  Transport", NeurIPS 2020; exact or Sinkhorn, the ``--otfusion-*`` options are
  the ``otfusion`` strategy's keys), then averaged the same way; it also fuses
  models of different widths (``--widths``) into the reference's width;
* ``ensemble``: the mean of the clients' softmax outputs (K forward passes, an
  upper reference rather than a single model);
* with ``--repair``, every merge again after REPAIR (Jordan, Sedghi, Saukh,
  Entezari and Neyshabur, "REPAIR: REnormalizing Permuted Activations for
  Interpolation Repair", ICLR 2023; :mod:`alignfl.core.merging.repair`) as adapted to
  federated data: ``<merge>+repair`` with ``--repair-data own`` (the default), each
  client's model measured on its own training split and the merged model on every
  client's, as a one-shot run with ``repair=on`` measures them (the same merged
  model); ``<merge>+repair-pooled`` with ``--repair-data pooled``, every model
  measured on the union of the clients' training splits, as REPAIR's authors
  measure on one data set (:func:`repair_merge`).

The reference is client ``--reference`` (0 by default). With ``--reference
universe`` there is none: ``matched-universe`` replaces ``matched-weight``, all
models matched jointly into one shared unit order (Crisostomi et al., "C2M3:
Cycle-Consistent Multi-Model Merging", NeurIPS 2024; :mod:`alignfl.core.merging.universe`,
Frank-Wolfe's settings as ``--universe-iterations`` and
``--universe-tolerance``) and averaged in client 0's unit order; the JSON
then also holds Frank-Wolfe's objective per iteration, the objective of the
final permutations and the cycle-consistency error that aligning onto client
0 would have had (per group; at most :data:`alignfl.core.merging.universe.MAX_PAIRS` pairs).
The merges that align onto a client (``l1``, ``ot``) are refused with it, and
the default ``--costs`` are then ``weight`` and ``bbp``. With ``--widths`` the
clients train models of those width multipliers (cycled over the clients; the
model must take ``width-factor``); models of different widths can only be fused
by ``ot`` (and ensembled): the plain average is left out, ``ot`` is the default
``--costs``, and any other cost asked for is refused before training.

Seed paper 002 reports that one-shot matching beats one-shot averaging; the gap
is largest for differently initialised models, whose units have no reason to
share an order. The options and their checks: :mod:`alignfl.fl_app.analysis.merge_options`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord
from torch import Tensor, nn

from alignfl.core.data import ImageDataset, dataset_info, load_dataset
from alignfl.core.merging.bbp import BBPSettings
from alignfl.core.merging.bbp_model import bbp_matched_average, growth_problem
from alignfl.core.merging.ot_fusion import OTSettings
from alignfl.core.merging.repair import (
    Site,
    UnitStats,
    assignment_coupling,
    carry_statistics,
    repair_in_order,
    sites_of,
    unit_statistics,
)
from alignfl.core.merging.universe import UniverseSettings
from alignfl.core.metrics.ensemble import score_models
from alignfl.core.model_io import build_model_at, build_run_model, federated_state, independent_start, load_arrays
from alignfl.core.rounds.strategy import Merge, build_context, offline_replies
from alignfl.core.training.sgd import evaluate, round_generator, seed_everything, seed_torch, select_device
from alignfl.core.widths import width_of
from alignfl.fl_app.analysis import merge_options as options
from alignfl.fl_app.analysis.common import (
    AnalysisError,
    Subcommand,
    check_choice,
    check_positive_int,
    pan_settings,
    pyplot,
    settings_from_arguments,
    write_json,
)
from alignfl.fl_app.analysis.merge_options import BBP, OT, OWN, POOLED, REPAIR_DATA, UNIVERSE
from alignfl.fl_app.client_app import client_data
from alignfl.fl_app.config import ConfigError, RunConfig, parse_run_config
from alignfl.models import Permutable
from alignfl.models.protocol import head_of
from alignfl.plugins.options import settings_fields
from alignfl.strategies import get_strategy
from alignfl.strategies.base import LocalUpdate


def train_clients(
    config: RunConfig, num_clients: int, same_init: bool, device: torch.device
) -> tuple[list[dict[str, Tensor]], list[int], ImageDataset, Tensor]:
    """Train one model per partition as round 1 of a federated run trains it (its partition less its local test
    split, :func:`alignfl.fl_app.client_app.client_data`; round 1's seeds), from the server's initial model
    (``same_init``) or the client's own initialisation (``client-init=independent``), client ``k`` at width
    ``width_of(config, k)``; returns their state dicts (CPU), example counts, the dataset and the clients' class
    counts (K x C). A one-shot run of the same settings trains the same models."""
    dataset = load_dataset(config.dataset, config.data_root or None)
    seed_everything(config.seed)  # as the ServerApp before it builds the initial model
    shared = federated_state(build_run_model(config, dataset))
    states, counts, classes = [], [], []
    for client in range(num_clients):
        try:
            data = client_data(config, client, num_clients)
        except ValueError as error:
            raise AnalysisError(f"client {client} of {num_clients}: {error}") from None
        start = shared if same_init else independent_start(config, dataset.input_shape, dataset.num_classes, client)
        model = build_model_at(config, dataset.input_shape, dataset.num_classes, width_of(config, client)).to(device)
        load_arrays(model, ArrayRecord(start), start)
        generator = round_generator(config.seed, 1, client)
        seed_torch(int(torch.randint(0, 2**62, (1,), generator=generator)), device)
        LocalUpdate(config, context=None).train(model, data.train_x, data.train_y, generator, device)
        states.append({key: value.detach().cpu().clone() for key, value in federated_state(model).items()})
        counts.append(len(data.train_y))
        classes.append(torch.bincount(data.train_y, minlength=dataset.num_classes))
    return states, counts, dataset, torch.stack(classes)


def strategy_merge(
    config: RunConfig,
    model: nn.Module,
    strategy: str,
    keys: Mapping[str, Any],
    states: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    reference: Mapping[str, Tensor],
) -> Merge:
    """``states`` merged by ``strategy``'s own server side with its run-config ``keys``, as round 1 of a federated
    run of ``config`` (the clients' training settings) merges such replies onto ``reference``: one merge, written
    once, for runs and offline tools alike. ``model``: the run's model (its permutation description and head).
    ``config``'s own algorithm's keys are left out: only ``keys`` set ``strategy``'s."""
    own = {setting.key for setting in settings_fields(type(config.settings))}
    common = {key: value for key, value in config.to_run_config().items() if key not in own}
    values = {**common, "client-widths": "", "strategy": strategy, **keys}
    try:
        run = parse_run_config(values)
        server = get_strategy(strategy).server(build_context(run, model))
    except ConfigError as error:
        raise AnalysisError(f"strategy '{strategy}' cannot merge these models: {error}") from None
    merge = server.aggregate(1, offline_replies(states, weights), ArrayRecord(dict(reference)))
    if merge is None:
        raise AnalysisError(f"strategy '{strategy}' made no merge of {len(states)} models")
    return merge


def prefixed(prefix: str, settings: Any) -> dict[str, Any]:
    """A settings object's fields as the run-config keys ``<prefix><key>`` that a strategy borrows them under."""
    return {f"{prefix}{s.key}": getattr(settings, s.name) for s in settings_fields(type(settings))}


def matched_keys(cost: str, iterations: int) -> dict[str, Any]:
    """``matched``'s keys for aligning onto the reference client, then ``iterations - 1`` times onto the mean."""
    if iterations == 1:
        return {"matched-cost": cost, "matched-reference": "client"}
    return {
        "matched-cost": cost,
        "matched-reference": "iterative",
        "matched-iterative-start": "client",
        "matched-iterations": iterations,
    }


def merge_accuracies(
    config: RunConfig,
    model: nn.Module,
    states: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    x: Tensor,
    y: Tensor,
    costs: Sequence[str],
    iterations: int,
    device: torch.device,
    class_counts: Tensor | None = None,
    bbp: BBPSettings | None = None,
    ot: OTSettings | None = None,
    reference: int | str = 0,
    universe: UniverseSettings | None = None,
    diagnostics: dict[str, Any] | None = None,
    repair_data: Sequence[Tensor] | None = None,
    repair_on: Sequence[str] = (OWN,),
) -> tuple[list[float], dict[str, float], dict[str, int]]:
    """Test accuracy of each state and of every merge (``average``, ``matched-<cost>``, ``ensemble``), and the
    global width per layer of the BBP-MAP merge (the reference's without ``bbp`` among ``costs``). The merges are
    the strategies' own (:func:`strategy_merge`: ``fedavg``, ``matched``, ``otfusion`` as round 1 of a run of
    ``config`` merges them, the matching's order seeded by its seed); ``bbp`` is FedMA's BBP-MAP of every layer at
    once. States of different widths are merged by ``ot`` only (and ensembled). ``repair_data``: each state's
    client's training inputs; every merge is then also scored after REPAIR (:func:`repair_merge`) with its
    statistics taken as each of ``repair_on`` says (:data:`~alignfl.fl_app.analysis.merge_options.REPAIR_DATA`):
    ``<merge>+repair`` (own) and ``<merge>+repair-pooled`` (pooled).

    ``reference="universe"``: the ``weight`` cost matches all states jointly (``matched-universe``, with
    ``universe``'s settings) and ``diagnostics``, if given, receives its ``universe-objective`` (per iteration),
    ``universe-projected`` and ``cycle-consistency-error`` (of aligning onto state 0); costs that align onto a
    state (``l1``, ``ot``) are refused."""
    if not isinstance(model, Permutable):
        raise AnalysisError(f"{type(model).__name__} has no permutation_spec(); matching needs one")
    spec = model.permutation_spec()
    joint = reference == UNIVERSE
    if joint:
        options.refuse_costs_off_universe(costs)
    reference = 0 if joint else int(reference)

    def accuracy(state: Mapping[str, Tensor]) -> float:
        load_arrays(model, ArrayRecord({k: v for k, v in state.items() if v.is_floating_point()}))
        return evaluate(model, x, y, device)[1]

    def merged_by(strategy: str, keys: Mapping[str, Any]) -> Merge:
        return strategy_merge(config, model, strategy, keys, states, weights, states[reference])

    clients = [accuracy(state) for state in states]
    sizes = [spec.group_sizes(state) for state in states]
    equal = all(size == sizes[reference] for size in sizes)
    merges: dict[str, Merge] = {}
    if equal:
        merges["average"] = merged_by("fedavg", {})
    widths: dict[str, int] = {}
    for cost in costs:
        if cost == OT:
            merges[f"matched-{cost}"] = merged_by("otfusion", prefixed("otfusion-", ot or OTSettings()))
        elif not equal:
            continue
        elif cost == BBP:
            result = bbp_matched_average(
                states, weights, spec, bbp, class_counts=class_counts, head=head_of(model).keys
            )
            widths = result.widths
            couplings = [
                {group: assignment_coupling(result.assignments[group][k], width) for group, width in widths.items()}
                for k in range(len(states))
            ]
            merges[f"matched-{cost}"] = Merge(ArrayRecord(result.state), couplings)
        elif joint:
            keys = {"matched-reference": UNIVERSE, **prefixed("matched-universe-", universe or UniverseSettings())}
            merges["matched-universe"] = merged_by("matched", keys)
            if diagnostics is not None:
                universe_keys = ("universe-objective", "universe-projected", "cycle-consistency-error")
                diagnostics.update({key: merges["matched-universe"].metrics[key] for key in universe_keys})
        else:
            merges[f"matched-{cost}"] = merged_by("matched", matched_keys(cost, iterations))
    merged: dict[str, float] = {}
    for name, merge in merges.items():
        state = merge.arrays.to_torch_state_dict()
        merged[name] = accuracy(state)
        maps = merge.unit_maps or [{} for _ in states]
        for on in repair_on if repair_data is not None else ():
            repaired = repair_merge(model, state, states, maps, repair_data, weights, device, on)
            merged[repair_key(name, on)] = accuracy(repaired)
    merged["ensemble"] = score_models(model, [ArrayRecord(state) for state in states], x, y, device).ensemble
    return clients, merged, widths or sizes[reference]


def repair_key(merge: str, on: str) -> str:
    """The accuracy key of ``merge`` after REPAIR with its statistics taken as ``on`` says."""
    return f"{merge}+repair" if on == OWN else f"{merge}+repair-{on}"


def repair_merge(
    model: nn.Module,
    merged: Mapping[str, Tensor],
    states: Sequence[Mapping[str, Tensor]],
    unit_maps: Sequence[Mapping[str, Tensor]],
    data: Sequence[Tensor],
    weights: Sequence[float],
    device: torch.device,
    on: str = OWN,
) -> dict[str, Tensor]:
    """``merged`` after REPAIR (:mod:`alignfl.core.merging.repair`): per unit, the mean and std the states' units had
    (carried onto the merged units by ``unit_maps``), averaged with ``weights`` (their example counts), is the
    target of the merged model's unit, whose own statistics are measured after the layers before it are corrected.

    ``on`` says on which inputs (``data``: each state's client's training inputs):

    * ``own``: each state on its own client's inputs, and the merged model on every client's, averaged the same way
      (like with like), as a federated round with ``repair=on`` makes it (no client sees another's data or model);
    * ``pooled``: every state and the merged model on one set, the union of ``data``, as REPAIR's authors measure
      the endpoints and their interpolation on one data set. In a federation that would need every client to
      evaluate every other client's model (or to send its data), so only this offline tool, which holds every
      client's data, can do it; with one client, or every client holding the same inputs, it equals ``own``.
    """
    check_choice("repair statistics", on, REPAIR_DATA)
    sites = sites_of(model, tuple(data[0].shape[1:]))
    inputs = [torch.cat(list(data))] if on == POOLED else list(data)
    per_state = inputs * len(states) if on == POOLED else inputs

    def statistics(state: Mapping[str, Tensor], x: Tensor, measured: Sequence[Site] = sites) -> dict[str, Tensor]:
        load_arrays(model, ArrayRecord({k: v for k, v in state.items() if v.is_floating_point()}))
        return unit_statistics(model, measured, x, device)

    merged_shapes = {key: tuple(value.shape) for key, value in merged.items()}
    targets = [
        carry_statistics(
            statistics(state, x), sites, {k: tuple(v.shape) for k, v in state.items()}, merged_shapes, maps
        )
        for state, x, maps in zip(states, per_state, unit_maps, strict=True)
    ]

    def measure(state: Mapping[str, Tensor], site: Site) -> list[UnitStats]:
        values = [
            carry_statistics(statistics(state, x, [site]), [site], merged_shapes, merged_shapes)[site.name]
            for x in inputs
        ]
        return values * len(states) if on == POOLED else values  # one measurement stands for every client

    return repair_in_order(merged, sites, targets, weights, measure)[0]


def run(args: argparse.Namespace, out: Path) -> list[Path]:
    if check_positive_int("--clients", args.clients) < 2:
        raise AnalysisError(f"--clients must be at least 2 (there is nothing to merge), got {args.clients}")
    check_choice("--init", args.init, options.INITS)
    check_positive_int("--match-iterations", args.match_iterations)
    reference = options.reference(args.reference, args.clients)
    widths = options.widths(args.widths)
    costs = options.costs(args.costs, widths, args.clients, reference)
    repair_on = options.repair_data(args)
    universe = settings_from_arguments(args, UniverseSettings, "universe-")
    pan_settings(args.pan_mode, args.pan_t, args.pan_a)
    config = options.run_config(args)
    bbp = settings_from_arguments(args, BBPSettings, "bbp-")
    ot = settings_from_arguments(args, OTSettings, "otfusion-")
    try:
        built = [build_model_at(config, *dataset_info(config.dataset), width) for width in set(widths)]
    except (ConfigError, ValueError) as error:
        raise AnalysisError(f"--widths {args.widths!r}: {error}") from None
    grows = BBP in costs and isinstance(built[0], Permutable)
    problem = growth_problem(built[0].permutation_spec()) if grows else None
    if problem is not None:
        given = "--costs bbp" if args.costs else "--costs bbp (a default)"
        raise AnalysisError(f"{given} is not allowed with --model {config.model}: {problem}; give --costs without bbp")

    device = select_device(config.device)
    states, counts, dataset, classes = train_clients(config, args.clients, args.init == "same", device)
    model = build_run_model(config, dataset).to(device)
    diagnostics: dict[str, Any] = {}
    repair_data = [client_data(config, k, args.clients).train_x for k in range(args.clients)] if repair_on else None
    clients, merged, widths_out = merge_accuracies(
        config,
        model,
        states,
        counts,
        dataset.test_x,
        dataset.test_y,
        costs,
        args.match_iterations,
        device,
        classes,
        bbp,
        ot,
        reference,
        universe,
        diagnostics,
        repair_data,
        (repair_on,) if repair_on else (),
    )

    print(f"{'model':<18} {'examples':>8} {'accuracy':>9}")
    for index, (count, acc) in enumerate(zip(counts, clients)):
        print(f"{f'client {index}':<18} {count:>8} {acc:>9.4f}")
    for name, acc in merged.items():
        print(f"{name:<18} {sum(counts):>8} {acc:>9.4f}")
    if BBP in costs:
        print(
            f"global width per layer of matched-bbp: {widths_out} "
            f"(clients: {model.permutation_spec().group_sizes(states[0])})"
        )
    payload: dict[str, Any] = {
        "tool": "merge",
        "model": args.model,
        "dataset": args.dataset,
        "clients": args.clients,
        "init": args.init,
        "epochs": args.epochs,
        "partitioner": args.partitioner,
        "dirichlet-alpha": args.dirichlet_alpha,
        "match-iterations": args.match_iterations,
        "repair": args.repair,
        "repair-data": repair_on,
        "pan": config.pan_signature(),
        "seed": args.seed,
        "reference": "universe" if reference == UNIVERSE else f"client {reference}",
        "widths": list(widths),
        "examples": counts,
        "client-accuracy": clients,
        "merged-accuracy": merged,
        "bbp-global-width": widths_out if BBP in costs else None,
        "bbp": dataclasses.asdict(bbp),
        "otfusion": dataclasses.asdict(ot),
        "universe": dataclasses.asdict(universe) if reference == UNIVERSE else None,
        **diagnostics,
    }
    json_path = write_json(out / "merge.json", payload)

    plt = pyplot()
    labels = [f"client {i}" for i in range(len(clients))] + list(merged)
    values = clients + list(merged.values())
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(labels)), 4))
    ax.bar(range(len(labels)), values, color=["0.6"] * len(clients) + [f"C{i}" for i in range(len(merged))])
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    ax.set(
        ylabel="test accuracy",
        ylim=(0, 1),
        title=f"one-shot merge: {args.clients} x {args.model} on {args.dataset} ({args.init} init)",
    )
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    png_path = out / "merge.png"
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return [json_path, png_path]


COMMAND = Subcommand(
    name="merge",
    summary="train K models on non-IID splits; compare plain average, matched average, OT fusion and ensemble",
    description=__doc__,
    add_arguments=options.add_arguments,
    run=run,
)
