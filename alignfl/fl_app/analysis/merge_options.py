"""The merge tool's options (``python -m alignfl.fl_app.analysis merge``) and their checks, all made before any
training.

Each refusal names the option as the user typed it, the value and what is allowed: the local-training settings
are checked as a run config (:func:`alignfl.fl_app.config.parse_run_config`, so training matches the federated runs) and
its messages are rewritten from run-config keys to this tool's options (``local-epochs`` is ``--epochs`` here).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from alignfl.core.data import list_datasets
from alignfl.core.merging.alignment import list_costs
from alignfl.core.merging.bbp import BBPSettings
from alignfl.core.merging.ot_fusion import OTSettings
from alignfl.core.merging.universe import UniverseSettings
from alignfl.fl_app.analysis.common import AnalysisError, add_common_arguments, add_settings_arguments, check_choice
from alignfl.fl_app.config import ConfigError, RunConfig, parse_run_config
from alignfl.models import list_models

INITS = ("same", "different")
BBP = "bbp"
OT = "ot"
MERGE_COSTS = (*list_costs(), BBP, OT)
UNIVERSE = "universe"
UNIVERSE_COSTS = ("weight", BBP)
"""The merges ``--reference universe`` takes: the universe matching (weight similarity) and BBP-MAP (no reference)."""
OWN, POOLED = "own", "pooled"
REPAIR_DATA = (OWN, POOLED)
"""Where ``--repair`` measures the units (:func:`alignfl.fl_app.analysis.merge.repair_merge`): each client's model on
its own training split, the merged model on every client's (as ``repair=on`` does), or every model on the union."""
FLAGS = {"local-epochs": "--epochs", "client-widths": "--widths"}
"""Run-config keys whose option here has another name; every other key checked is ``--<key>``."""


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
        help="also score every merge after REPAIR, statistics as --repair-data says",
    )
    parser.add_argument(
        "--repair-data",
        choices=REPAIR_DATA,
        default=None,
        help="with --repair: own (each client's model on its own training split, the merged model on every "
        "client's, as repair=on) or pooled (every model on the union of the clients' training splits, as "
        "REPAIR's authors measure on one data set) (default: own)",
    )
    parser.add_argument("--pan-mode", default="off", help="PAN mode of every model (default: off)")
    parser.add_argument("--pan-t", type=float, default=1.0, help="PAN period T (default: 1)")
    parser.add_argument("--pan-a", type=float, default=0.0, help="PAN amplitude A (default: 0)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:<index> (default: auto)")
    add_common_arguments(parser)


def as_options(message: str) -> str:
    """A run-config refusal in this tool's words: ``run-config key 'local-epochs' = 0`` becomes ``--epochs 0``."""

    def flag(match: re.Match[str]) -> str:
        key = match.group(1)
        return FLAGS.get(key, f"--{key}") + (" " if match.group(2) else "")

    return re.sub(r"run-config key '([a-z0-9-]+)'( = )?", flag, message)


def run_config(args: argparse.Namespace) -> RunConfig:
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
        raise AnalysisError(as_options(str(error))) from error


def repair_data(args: argparse.Namespace) -> str | None:
    """Where ``--repair`` measures (:data:`REPAIR_DATA`), None without ``--repair``; ``--repair-data`` alone is
    refused, as it would change nothing."""
    if args.repair_data is not None and not args.repair:
        raise AnalysisError(f"--repair-data {args.repair_data} needs --repair (it says where REPAIR measures)")
    return (args.repair_data or OWN) if args.repair else None


def widths(text: str) -> tuple[float, ...]:
    """``--widths``: comma-separated multipliers > 0."""
    try:
        values = tuple(float(item) for item in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(w > 0 and w != float("inf") for w in values):
        raise AnalysisError(f"--widths must be comma-separated numbers > 0, got {text!r}")
    return values


def refuse_costs_off_universe(costs: Sequence[str]) -> None:
    """Universe matching has no reference: a cost that aligns onto one client cannot join it."""
    refused = [cost for cost in costs if cost not in UNIVERSE_COSTS]
    if refused:
        raise AnalysisError(
            f"--costs {refused[0]!r} is not allowed with --reference universe: it aligns onto one client; "
            f"choose from {list(UNIVERSE_COSTS)} or give a client index as --reference"
        )


def reference(text: str, clients: int) -> int | str:
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


def costs(given: list[str] | None, widths: Sequence[float], clients: int, reference: int | str) -> list[str]:
    """The matchings to compare (None: every one that applies); refuses one that cannot merge the clients' models,
    which would otherwise be left out of the results without a word."""
    mixed = len({widths[client % len(widths)] for client in range(clients)}) > 1
    shown = ",".join(f"{width:g}" for width in widths)
    if mixed and reference == UNIVERSE:
        raise AnalysisError(
            f"--reference universe cannot match models of different widths (--widths {shown} over {clients} "
            "clients): give one width, or a client index as --reference with --costs ot"
        )
    if given is None:
        return [OT] if mixed else list(UNIVERSE_COSTS if reference == UNIVERSE else MERGE_COSTS)
    for cost in given:
        check_choice("--costs", cost, MERGE_COSTS)
    if reference == UNIVERSE:
        refuse_costs_off_universe(given)
    unmergeable = [cost for cost in given if cost != OT]
    if mixed and unmergeable:
        raise AnalysisError(
            f"--costs {' '.join(unmergeable)} cannot merge models of different widths (--widths {shown} over "
            f"{clients} clients): only ot can (the ensemble is always reported); give --costs ot, or one width"
        )
    return list(given)
