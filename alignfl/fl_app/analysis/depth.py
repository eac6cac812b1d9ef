"""Where to start grouping a Ψ-Net: layer-wise total variance of class preference vectors.

Ψ-Net / Fed2 (Yu et al., "Heterogeneous Federated Learning", arXiv 2020, published as "Fed2: Feature-Aligned
Federated Learning", KDD 2021; §3.2, Eq. 5 of the arXiv version): with ``P_{l,i}`` the normalised class
preference vector of unit ``i`` of layer ``l`` (Eq. 2, computed by
:func:`alignfl.fl_app.analysis.preference.preference_vectors`),

    TV_l = (1 / L) * sum_i || P_{l,i} - E(P_{l,i}) ||_2

where ``E`` is the mean over the layer's units and ``L`` the number of units. Low
TV: the layer's units serve all classes alike (basic features, share them); high
TV: units specialise (group them). Units with an all-zero vector (dead for every
sample used) are left out of both the mean and the average, as are they in the
preference tool's agreement.

The paper picks the depth "empirically" from where TV rises. The suggestion here
makes that one rule: group from the layer with the largest rise
``TV_l - TV_{l-1}`` (``l >= 1``), i.e. ``psi-depth = l``. Layers are the model's
permutation groups in input-to-output order, which for the VGG nets is convs then
hidden FCs, the order ``psi-depth`` counts.

Run it on a *trained plain* model (e.g. a FedAvg ``vgg9`` run folder); on an
untrained one the numbers describe the initialisation only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor

from alignfl.fl_app.analysis.common import (
    AnalysisError,
    Subcommand,
    add_common_arguments,
    add_fresh_model_arguments,
    check_positive_int,
    pyplot,
    run_or_fresh_model,
    save_outputs,
)
from alignfl.fl_app.analysis.preference import DEFAULT_SAMPLES_PER_CLASS, preference_vectors


def total_variance(preferences: dict[str, Tensor]) -> dict[str, float]:
    """Layer -> TV (Eq. 5) of its ``(J, C)`` normalised preference matrix; NaN when no unit is active."""
    result = {}
    for layer, matrix in preferences.items():
        active = matrix[matrix.abs().sum(1) > 0].double()
        if len(active) == 0:
            result[layer] = float("nan")
            continue
        result[layer] = float((active - active.mean(0, keepdim=True)).norm(dim=1).mean())
    return result


def suggest_depth(variances: list[float]) -> int:
    """The ``psi-depth`` to use: index of the layer with the largest TV rise over its predecessor."""
    if len(variances) < 2:
        raise AnalysisError(f"need at least two layers to find a rise in total variance, got {len(variances)}")
    values = torch.tensor(variances, dtype=torch.float64)
    if not torch.isfinite(values).all():
        raise AnalysisError("some layer has no active unit (total variance NaN); use more samples per class")
    return int(torch.argmax(values[1:] - values[:-1])) + 1


# --- command line -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-a", help="run folder or model.pt (with config.json beside it) of a trained plain model"
    )
    add_fresh_model_arguments(parser, with_pan=True)
    parser.add_argument(
        "--samples-per-class",
        type=int,
        default=DEFAULT_SAMPLES_PER_CLASS,
        help=f"test samples per class (default {DEFAULT_SAMPLES_PER_CLASS})",
    )
    add_common_arguments(parser)


def run(args: argparse.Namespace, out: Path) -> list[Path]:
    check_positive_int("--samples-per-class", args.samples_per_class)
    loaded = run_or_fresh_model(args.model_a, "--model-a", args)
    data = loaded.dataset
    prefs = preference_vectors(
        loaded.model, data.test_x, data.test_y, data.num_classes, samples_per_class=args.samples_per_class
    )
    variances = total_variance(prefs)
    layers = list(variances)
    depth = suggest_depth([variances[layer] for layer in layers])
    for index, layer in enumerate(layers):
        marker = "  <- group from here" if index == depth else ""
        print(f"{index:>3} {layer:<20} TV={variances[layer]:.4f}{marker}")
    print(f"suggested psi-depth = {depth}")
    payload = {
        "tool": "depth",
        "model": loaded.source,
        "dataset": data.name,
        "samples_per_class": args.samples_per_class,
        "definition": "TV_l = mean over active units of ||P_i - mean_i P_i||_2, P = L1-normalised class "
        "preference vectors (Fed2 Eqs. 2 and 5); psi-depth = layer of the largest TV rise",
        "layers": layers,
        "total_variance": [variances[layer] for layer in layers],
        "suggested_psi_depth": depth,
    }
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(layers)), 3.8))
    ax.plot(range(len(layers)), [variances[layer] for layer in layers], marker="o")
    ax.axvline(depth, color="tab:red", linestyle="--", label=f"suggested psi-depth = {depth}")
    ax.set_xticks(range(len(layers)), layers, rotation=45, ha="right")
    ax.set(ylabel="total variance (Eq. 5)", title=f"{loaded.source}")
    ax.legend()
    fig.tight_layout()
    return save_outputs(out, "depth", payload, fig)


COMMAND = Subcommand(
    name="depth",
    summary="layer-wise total variance of class preference vectors (Fed2 Eq. 5) and a suggested psi-depth",
    description=__doc__,
    add_arguments=add_arguments,
    run=run,
)
