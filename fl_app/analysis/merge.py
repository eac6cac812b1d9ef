"""One-shot merging: train K models on non-IID splits, then compare ways of merging them into one.

Each of ``--clients`` models trains ``--epochs`` of the project's local SGD
(:class:`strategies.base.LocalUpdate`) on its own partition of the dataset's
training split (``--partitioner``, Dirichlet by default) less its local test
split, exactly as round 1 of a federated run trains it, starting from the
server's initial model (``--init same``) or from the client's own
initialisation (``--init different``: ``client-init=independent``). A one-shot
run (``num-server-rounds=1``, ``client-init=independent``) of ``fedavg``,
``matched`` or ``otfusion`` with the same settings gives the same merged model
as ``average``, ``matched-<cost>`` and ``matched-ot`` here. Then, on the
dataset's test split, it reports the accuracy of

* every client model on its own;
* ``average``: the coordinate-wise average, weighted by example counts (one-shot FedAvg);
* ``matched-<cost>``: every model aligned onto client 0 with that cost (see
  :mod:`core.merging.alignment`), then averaged the same way; with
  ``--match-iterations N`` the models are aligned again onto the matched mean,
  ``N`` passes in all;
* ``matched-bbp``: FedMA's BBP-MAP matching of every layer in turn
  (:mod:`core.merging.bbp`, the authors' defaults), which may open new global units:
  the merged model can be wider than the clients' (its width per layer is
  reported); the output layer is averaged per class with the clients' class
  counts, as FedMA does;
* ``matched-ot``: every model carried onto the reference model by optimal
  transport (:mod:`core.merging.ot_fusion`: Singh & Jaggi, "Model Fusion via Optimal
  Transport", NeurIPS 2020; exact or Sinkhorn, the ``--otfusion-*`` options are
  the ``otfusion`` strategy's keys), then averaged the same way; it also fuses
  models of different widths (``--widths``) into the reference's width;
* ``ensemble``: the mean of the clients' softmax outputs (K forward passes, an
  upper reference rather than a single model);
* with ``--repair``, every merge again after REPAIR (``<merge>+repair``: Jordan,
  Sedghi, Saukh, Entezari and Neyshabur, "REPAIR: REnormalizing Permuted
  Activations for Interpolation Repair", ICLR 2023; :mod:`core.merging.repair`), each
  client's statistics taken on its own training split, as a one-shot run with
  ``repair=on`` takes them (the same merged model).

The reference is client ``--reference`` (0 by default). With ``--reference
universe`` there is none: ``matched-universe`` replaces ``matched-weight``, all
models matched jointly into one shared unit order (Crisostomi et al., "C2M3:
Cycle-Consistent Multi-Model Merging", NeurIPS 2024; :mod:`core.merging.universe`,
Frank-Wolfe's settings as ``--universe-iterations`` and
``--universe-tolerance``) and averaged in client 0's unit order; the JSON
then also holds Frank-Wolfe's objective per iteration, the objective of the
final permutations and the cycle-consistency error that aligning onto client
0 would have had (per group; at most :data:`core.merging.universe.MAX_PAIRS` pairs).
The merges that align onto a client (``l1``, ``ot``) are refused with it, and
the default ``--costs`` are then ``weight`` and ``bbp``. With ``--widths`` the
clients train models of those width multipliers (cycled over the clients; the
model must take ``width-factor``); models of different widths can only be fused
by ``ot`` (and ensembled): the plain average is left out, ``ot`` is the default
``--costs``, and any other cost asked for is refused before training.

Seed paper 002 reports that one-shot matching beats one-shot averaging; the gap
is largest for differently initialised models, whose units have no reason to
share an order.
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

from core.data import ImageDataset, dataset_info, list_datasets, load_dataset
from core.merging.alignment import align_and_average, list_costs, matching_generator, weighted_average
from core.merging.bbp import BBPSettings
from core.merging.bbp_model import bbp_matched_average
from core.merging.ot_fusion import OTSettings, ot_fuse
from core.merging.repair import (
    Site,
    UnitStats,
    assignment_coupling,
    carry_statistics,
    repair_in_order,
    sites_of,
    unit_statistics,
)
from core.merging.universe import UniverseSettings, cycle_consistency_error, universe_merge
from core.metrics.ensemble import score_models
from core.model_io import build_model_at, build_run_model, federated_state, independent_start, load_arrays
from core.training.sgd import evaluate, round_generator, seed_everything, seed_torch, select_device
from core.widths import width_of
from fl_app.analysis.common import (
    AnalysisError,
    Subcommand,
    add_common_arguments,
    add_settings_arguments,
    check_choice,
    check_positive_int,
    pan_settings,
    pyplot,
    settings_from_arguments,
    write_json,
)
from fl_app.client_app import client_data
from fl_app.config import ConfigError, RunConfig, parse_run_config
from models import Permutable, list_models
from models.protocol import head_of
from strategies.base import LocalUpdate

INITS = ("same", "different")
BBP = "bbp"
OT = "ot"
MERGE_COSTS = (*list_costs(), BBP, OT)
UNIVERSE = "universe"
UNIVERSE_COSTS = ("weight", BBP)
"""The merges ``--reference universe`` takes: the universe matching (weight similarity) and BBP-MAP (no reference)."""


def train_clients(
    config: RunConfig, num_clients: int, same_init: bool, device: torch.device
) -> tuple[list[dict[str, Tensor]], list[int], ImageDataset, Tensor]:
    """Train one model per partition as round 1 of a federated run trains it (its partition less its local test
    split, :func:`fl_app.client_app.client_data`; round 1's seeds), from the server's initial model
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


def merge_accuracies(
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
    seed: int = 0,
    universe: UniverseSettings | None = None,
    diagnostics: dict[str, Any] | None = None,
    repair_data: Sequence[Tensor] | None = None,
) -> tuple[list[float], dict[str, float], dict[str, int]]:
    """Test accuracy of each state and of every merge (``average``, ``matched-<cost>``, ``ensemble``), and the
    global width per layer of the BBP-MAP merge (the reference's without ``bbp`` among ``costs``). States of
    different widths are merged by ``ot`` only (and ensembled). ``seed``: the run's, for the matching's order
    (:func:`core.merging.alignment.matching_generator`, round 1 as a one-shot run). ``repair_data``: each state's
    client's training inputs; every merge is then also scored after REPAIR (``<merge>+repair``, :func:`repair_merge`).

    ``reference="universe"``: the ``weight`` cost matches all states jointly (``matched-universe``, with
    ``universe``'s settings) and ``diagnostics``, if given, receives its ``universe-objective`` (per iteration),
    ``universe-projected`` and ``cycle-consistency-error`` (of aligning onto state 0); costs that align onto a
    state (``l1``, ``ot``) are refused."""
    if not isinstance(model, Permutable):
        raise AnalysisError(f"{type(model).__name__} has no permutation_spec(); matching needs one")
    spec = model.permutation_spec()
    joint = reference == UNIVERSE
    if joint:
        _refuse_costs_off_universe(costs)
    reference = 0 if joint else int(reference)

    def accuracy(state: Mapping[str, Tensor]) -> float:
        load_arrays(model, ArrayRecord({k: v for k, v in state.items() if v.is_floating_point()}))
        return evaluate(model, x, y, device)[1]

    clients = [accuracy(state) for state in states]
    sizes = [spec.group_sizes(state) for state in states]
    equal = all(size == sizes[reference] for size in sizes)
    merges: dict[str, tuple[Mapping[str, Tensor], list[dict[str, Tensor]]]] = {}
    if equal:
        merges["average"] = weighted_average(states, weights), [{} for _ in states]
    widths: dict[str, int] = {}
    for cost in costs:
        if cost == OT:
            fused, maps = ot_fuse(states[reference], states, weights, spec, ot or OTSettings())
            merges[f"matched-{cost}"] = fused, [dict(transport.couplings) for transport in maps]
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
            merges[f"matched-{cost}"] = result.state, couplings
        elif joint:
            state, match = universe_merge(states, weights, spec, universe, matching_generator(seed, 1))
            merges["matched-universe"] = state, list(match.permutations)
            if diagnostics is not None:
                diagnostics["universe-objective"] = match.objective
                diagnostics["universe-projected"] = match.projected
                diagnostics["cycle-consistency-error"] = cycle_consistency_error(
                    states[0], states, spec, generator=matching_generator(seed, 1)
                )
        else:
            merges[f"matched-{cost}"] = align_and_average(
                states[reference], states, weights, spec, cost, iterations, matching_generator(seed, 1)
            )
    merged: dict[str, float] = {}
    for name, (state, maps) in merges.items():
        merged[name] = accuracy(state)
        if repair_data is not None:
            merged[f"{name}+repair"] = accuracy(repair_merge(model, state, states, maps, repair_data, weights, device))
    merged["ensemble"] = score_models(model, [ArrayRecord(state) for state in states], x, y, device).ensemble
    return clients, merged, widths or sizes[reference]


def repair_merge(
    model: nn.Module,
    merged: Mapping[str, Tensor],
    states: Sequence[Mapping[str, Tensor]],
    unit_maps: Sequence[Mapping[str, Tensor]],
    data: Sequence[Tensor],
    weights: Sequence[float],
    device: torch.device,
) -> dict[str, Tensor]:
    """``merged`` after REPAIR, as a federated round with ``repair=on`` makes it (:mod:`core.merging.repair`): each
    state's unit statistics on its client's inputs ``data`` carried onto the merged units by ``unit_maps``, the merged
    model's on the same inputs, clients weighted by ``weights`` (their example counts)."""
    sites = sites_of(model, tuple(data[0].shape[1:]))

    def statistics(state: Mapping[str, Tensor], inputs: Tensor, measured: Sequence[Site] = sites) -> dict[str, Tensor]:
        load_arrays(model, ArrayRecord({k: v for k, v in state.items() if v.is_floating_point()}))
        return unit_statistics(model, measured, inputs, device)

    merged_shapes = {key: tuple(value.shape) for key, value in merged.items()}
    targets = [
        carry_statistics(
            statistics(state, inputs), sites, {k: tuple(v.shape) for k, v in state.items()}, merged_shapes, maps
        )
        for state, inputs, maps in zip(states, data, unit_maps, strict=True)
    ]

    def measure(state: Mapping[str, Tensor], site: Site) -> list[UnitStats]:
        return [
            carry_statistics(statistics(state, inputs, [site]), [site], merged_shapes, merged_shapes)[site.name]
            for inputs in data
        ]

    return repair_in_order(merged, sites, targets, weights, measure)[0]


# --- command line -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small-mlp", help=f"network, one of {list_models()} (default: small-mlp)")
    parser.add_argument("--dataset", default="digits", help=f"dataset, one of {list_datasets()} (default: digits)")
    parser.add_argument("--data-root", default="", help="dataset root (absolute path), default: the dataset's own")
    parser.add_argument("--clients", type=int, default=2, help="number of models K >= 2 (default: 2)")
    parser.add_argument(
        "--init", default="different", help=f"initialisation, one of {list(INITS)} (default: different)"
    )
    parser.add_argument("--epochs", type=int, default=5, help="local epochs per client (default: 5)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    parser.add_argument("--batch-size", type=int, default=64, help="mini-batch size (default: 64)")
    parser.add_argument(
        "--partitioner", default="dirichlet", help="how the training split is divided (default: dirichlet)"
    )
    parser.add_argument("--dirichlet-alpha", type=float, default=0.5, help="Dirichlet concentration (default: 0.5)")
    parser.add_argument("--classes-per-client", type=int, default=2, help="for --partitioner pathological (default: 2)")
    parser.add_argument(
        "--costs",
        nargs="+",
        default=None,
        help=f"matchings to compare (default: every one that applies, {list(MERGE_COSTS)}, with --reference universe "
        f"{list(UNIVERSE_COSTS)}, or only ot for clients of different --widths; bbp is FedMA's BBP-MAP, ot is OT fusion)",
    )
    parser.add_argument(
        "--reference",
        default="0",
        help="the client others are aligned onto, or universe: all matched jointly into one unit order (default: 0)",
    )
    add_settings_arguments(parser, UniverseSettings, "universe-")
    parser.add_argument(
        "--widths",
        default="1",
        help="clients' width multipliers of the model's width-factor, comma-separated, cycled (default: 1)",
    )
    parser.add_argument(
        "--match-iterations",
        type=int,
        default=1,
        help="alignment passes: onto client 0, then onto the matched mean (default: 1)",
    )
    add_settings_arguments(parser, BBPSettings, "bbp-")
    add_settings_arguments(parser, OTSettings, "otfusion-")
    parser.add_argument(
        "--repair",
        action="store_true",
        help="also score every merge after REPAIR, statistics on each client's training split (as repair=on)",
    )
    parser.add_argument("--pan-mode", default="off", help="PAN mode of every model (default: off)")
    parser.add_argument("--pan-t", type=float, default=1.0, help="PAN period T (default: 1)")
    parser.add_argument("--pan-a", type=float, default=0.0, help="PAN amplitude A (default: 0)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:<index> (default: auto)")
    add_common_arguments(parser)


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The local-training settings as a validated run config, so training matches the federated runs."""
    try:
        return parse_run_config(
            {
                "model": args.model,
                "dataset": args.dataset,
                "data-root": args.data_root,
                "local-epochs": args.epochs,
                "lr": args.lr,
                "batch-size": args.batch_size,
                "partitioner": args.partitioner,
                "dirichlet-alpha": args.dirichlet_alpha,
                "classes-per-client": args.classes_per_client,
                "pan-mode": args.pan_mode,
                "pan-t": args.pan_t,
                "pan-a": args.pan_a,
                "seed": args.seed,
                "device": args.device,
                "client-widths": "" if args.widths.strip() == "1" else args.widths,
            }
        )
    except ConfigError as error:
        raise AnalysisError(str(error).replace("run-config key '", "option '--")) from error


def _widths(text: str) -> tuple[float, ...]:
    try:
        widths = tuple(float(item) for item in text.split(","))
    except ValueError:
        widths = ()
    if not widths or not all(w > 0 and w != float("inf") for w in widths):
        raise AnalysisError(f"--widths must be comma-separated numbers > 0, got {text!r}")
    return widths


def _refuse_costs_off_universe(costs: Sequence[str]) -> None:
    """Universe matching has no reference: a cost that aligns onto one client cannot join it."""
    refused = [cost for cost in costs if cost not in UNIVERSE_COSTS]
    if refused:
        raise AnalysisError(
            f"--costs {refused[0]!r} is not allowed with --reference universe: it aligns onto one client; "
            f"choose from {list(UNIVERSE_COSTS)} or give a client index as --reference"
        )


def _reference(text: str, clients: int) -> int | str:
    """``--reference``: ``universe`` or a client index in ``[0, clients)``."""
    if text == UNIVERSE:
        return UNIVERSE
    try:
        index = int(text)
    except ValueError:
        index = -1
    if not 0 <= index < clients:
        raise AnalysisError(f"--reference must be a client index in [0, {clients}) or universe, got {text}")
    return index


def _costs(costs: list[str] | None, widths: Sequence[float], clients: int, reference: int | str) -> list[str]:
    """The matchings to compare (None: every one that applies); refuses one that cannot merge the clients' models,
    which would otherwise be left out of the results without a word."""
    mixed = len({widths[client % len(widths)] for client in range(clients)}) > 1
    given = ",".join(f"{width:g}" for width in widths)
    if mixed and reference == UNIVERSE:
        raise AnalysisError(
            f"--reference universe cannot match models of different widths (--widths {given} over {clients} "
            "clients): give one width, or a client index as --reference with --costs ot"
        )
    if costs is None:
        return [OT] if mixed else list(UNIVERSE_COSTS if reference == UNIVERSE else MERGE_COSTS)
    for cost in costs:
        check_choice("--costs", cost, MERGE_COSTS)
    if reference == UNIVERSE:
        _refuse_costs_off_universe(costs)
    unmergeable = [cost for cost in costs if cost != OT]
    if mixed and unmergeable:
        raise AnalysisError(
            f"--costs {' '.join(unmergeable)} cannot merge models of different widths (--widths {given} over "
            f"{clients} clients): only ot can (the ensemble is always reported); give --costs ot, or one width"
        )
    return list(costs)


def run(args: argparse.Namespace, out: Path) -> list[Path]:
    if check_positive_int("--clients", args.clients) < 2:
        raise AnalysisError(f"--clients must be at least 2 (there is nothing to merge), got {args.clients}")
    check_choice("--init", args.init, INITS)
    check_positive_int("--match-iterations", args.match_iterations)
    reference = _reference(args.reference, args.clients)
    widths = _widths(args.widths)
    costs = _costs(args.costs, widths, args.clients, reference)
    universe = settings_from_arguments(args, UniverseSettings, "universe-")
    pan_settings(args.pan_mode, args.pan_t, args.pan_a)
    config = _run_config(args)
    bbp = settings_from_arguments(args, BBPSettings, "bbp-")
    ot = settings_from_arguments(args, OTSettings, "otfusion-")
    try:
        for width in set(widths):
            build_model_at(config, *dataset_info(config.dataset), width)
    except (ConfigError, ValueError) as error:
        raise AnalysisError(f"--widths {args.widths!r}: {error}") from None

    device = select_device(config.device)
    states, counts, dataset, classes = train_clients(config, args.clients, args.init == "same", device)
    model = build_run_model(config, dataset).to(device)
    diagnostics: dict[str, Any] = {}
    repair_data = [client_data(config, k, args.clients).train_x for k in range(args.clients)] if args.repair else None
    clients, merged, widths_out = merge_accuracies(
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
        args.seed,
        universe,
        diagnostics,
        repair_data,
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
    add_arguments=add_arguments,
    run=run,
)
