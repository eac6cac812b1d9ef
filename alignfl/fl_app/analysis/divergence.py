"""Weight divergence across clients: how far each client's weights drift from their mean.

For every floating-point state-dict entry ``W`` (one parameter or BatchNorm statistic,
e.g. ``hidden.0.weight``), with client weights ``w_k`` (equal by default):

    mean W   = sum_k w_k W_k / sum_k w_k
    div(W)   = sum_k w_k ||W_k - mean W||^2 / sum_k w_k

i.e. the (weighted) mean over clients of the squared Frobenius distance to the mean
model, the quantity the PANs paper calls weight divergence. Results are **per state-dict
key**; :func:`divergence_by_layer` sums them per layer prefix (``hidden.0.weight`` and
``hidden.0.bias`` -> ``hidden.0``), which equals the divergence of the layer's
parameters taken as one vector. Integer entries (``num_batches_tracked``) are skipped.

It is meant to run on every round's client models, so it streams over the clients twice
per key (mean offset, then deviations), on offsets from the most heavily weighted client,
in float32 (float64 inputs stay float64), and never stacks the clients: memory is a few
copies of the largest entry, time is linear in clients x parameters (about 0.03 s per
client for 3M parameters on one CPU thread; relative error about 1e-5).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from alignfl.core.metrics.divergence import divergence_by_layer, normalised_weights, weight_divergence
from alignfl.fl_app.analysis.common import (
    AnalysisError,
    Subcommand,
    add_common_arguments,
    check_model_path,
    pyplot,
    read_state,
    save_outputs,
)

# --- command line -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", help="two or more run folders or model.pt files of the same network")
    parser.add_argument(
        "--weights",
        type=float,
        nargs="+",
        default=None,
        help="one weight per model, e.g. example counts (default: equal)",
    )
    add_common_arguments(parser, seed=False)


def run(args: argparse.Namespace, out: Path) -> list[Path]:
    if len(args.models) < 2:
        raise AnalysisError(f"weight-divergence compares at least 2 models, got {len(args.models)}")
    try:
        normalised_weights(args.weights, len(args.models))
    except ValueError as error:
        raise AnalysisError(str(error)) from None
    paths = [check_model_path(path, require_config=False)[0] for path in args.models]
    try:
        per_key = weight_divergence([read_state(path) for path in paths], args.weights)
    except ValueError as error:  # models of different networks
        raise AnalysisError(str(error)) from None
    per_layer = divergence_by_layer(per_key)
    for layer, value in per_layer.items():
        print(f"{layer:<32} {value:.6e}")
    payload = {
        "tool": "weight-divergence",
        "models": [str(p) for p in paths],
        "weights": args.weights,
        "definition": "weighted mean over models of ||W_k - mean W||^2 (squared Frobenius norm)",
        "per_key": per_key,
        "per_layer": per_layer,
        "total": sum(per_key.values()),
    }
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.5 * len(per_layer)), 4))
    ax.bar(range(len(per_layer)), list(per_layer.values()))
    ax.set_xticks(range(len(per_layer)), list(per_layer), rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="mean ||W_k - mean W||^2", title=f"weight divergence over {len(paths)} models")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return save_outputs(out, "weight-divergence", payload, fig)


COMMAND = Subcommand(
    name="weight-divergence",
    summary="per-layer weight divergence mean_k ||W_k - mean W||^2 of several models",
    description=__doc__,
    add_arguments=add_arguments,
    run=run,
)
