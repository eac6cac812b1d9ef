"""Class preference vectors of hidden units, and whether two models' units prefer the same class.

Ψ-Net / Fed2 (Yu et al., "Heterogeneous Federated Learning", arXiv 2020, published as "Fed2: Feature-Aligned
Federated Learning", KDD 2021; Eq. 2 of the arXiv version), used by the PANs paper (Li et al., "Federated
Learning with Position-Aware Neurons", CVPR 2022) to visualise neurons: unit ``j``'s preference for class ``c`` is

    p_c[j] = sum over class-c samples x of  A_j(x) * dZ_c / dA_j(x)

with ``A_j`` the unit's activation and ``Z_c`` the class-``c`` logit (the pre-softmax
"prediction confidence"; gradient x activation is the first-order contribution of the
unit to ``Z_c``). Here:

* ``A`` is read where :mod:`alignfl.fl_app.analysis.units` reads it: after the PAN and the
  non-linearity; for channels the product is summed over spatial positions;
* the sum over samples is a **mean** over the class-``c`` samples used (Eq. 2's "averaged
  on B batch trials"), so unequal class counts do not tilt the vector;
* each unit's vector is normalised by its L1 norm ``sum_c |p_c|``. Eq. 5 divides by
  ``sum_c p_c``, which equals this when every ``p_c >= 0`` but is undefined once some
  contributions are negative, as they are in general. A unit with ``p = 0`` (dead for
  every sample) stays all-zero and is counted as ``inactive``.

A unit's preferred class is ``argmax_c p_c``; two models of the same architecture are
compared by the fraction of units, active in both, that prefer the same class.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from alignfl.fl_app.analysis.common import (
    AnalysisError,
    Subcommand,
    add_common_arguments,
    add_fresh_model_arguments,
    check_model_path,
    check_positive_int,
    load_run_model,
    pyplot,
    run_or_fresh_model,
    save_outputs,
)
from alignfl.fl_app.analysis.units import capture_units, group_sizes

DEFAULT_SAMPLES_PER_CLASS = 100


def preference_vectors(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    num_classes: int,
    *,
    samples_per_class: int | None = None,
    batch_size: int = 256,
    normalise: bool = True,
) -> dict[str, Tensor]:
    """Group -> ``(J, C)`` matrix of class preference vectors (rows normalised unless ``normalise=False``).

    Uses the first ``samples_per_class`` samples of each class in ``x`` (all when None).
    A class without samples gets a zero column.
    """
    check_positive_int("num_classes", num_classes)
    if samples_per_class is not None:
        check_positive_int("samples_per_class", samples_per_class)
    sizes = group_sizes(model)
    totals = {group: torch.zeros(units, num_classes, dtype=torch.float64) for group, units in sizes.items()}
    model.eval()
    with capture_units(model) as acts, torch.enable_grad():
        for c in range(num_classes):
            members = (y == c).nonzero().flatten()[:samples_per_class]
            for batch in members.split(check_positive_int("batch_size", batch_size)):
                inputs = x[batch].detach().requires_grad_(True)  # activations need a graph even if weights are frozen
                logit = model(inputs)[:, c].sum()
                captured = [acts.raw_of(group) for group in sizes]
                grads = torch.autograd.grad(logit, captured)
                for group, a, g in zip(sizes, captured, grads):
                    totals[group][:, c] += acts.as_units(group, a.detach() * g).sum(dim=(0, 2)).double()
            if len(members):
                for matrix in totals.values():
                    matrix[:, c] /= len(members)
    if not normalise:
        return {group: m.float() for group, m in totals.items()}
    return {group: (m / m.abs().sum(1, keepdim=True).clamp_min(1e-300)).float() for group, m in totals.items()}


@dataclass(frozen=True)
class PreferenceAgreement:
    """One group: units active in both models, and the fraction of those preferring the same class."""

    units: int
    active: int
    agreement: float


def compare_preferences(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, PreferenceAgreement]:
    """Per group: how many units prefer the same class (argmax) in both models."""
    if {g: tuple(m.shape) for g, m in a.items()} != {g: tuple(m.shape) for g, m in b.items()}:
        raise AnalysisError("preference matrices of the two models differ in groups or shapes")
    result = {}
    for group, pa in a.items():
        pb = b[group]
        active = (pa.abs().sum(1) > 0) & (pb.abs().sum(1) > 0)
        same = (pa.argmax(1) == pb.argmax(1)) & active
        count = int(active.sum())
        result[group] = PreferenceAgreement(
            units=len(pa), active=count, agreement=int(same.sum()) / count if count else float("nan")
        )
    return result


# --- command line -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-a", help="run folder or model.pt (with config.json beside it)")
    add_fresh_model_arguments(parser, with_pan=True)
    parser.add_argument("--model-b", help="optional second run folder or model.pt to compare with")
    parser.add_argument(
        "--samples-per-class",
        type=int,
        default=DEFAULT_SAMPLES_PER_CLASS,
        help=f"test samples per class (default {DEFAULT_SAMPLES_PER_CLASS})",
    )
    parser.add_argument("--layer", default=None, help="group shown in the heatmap (default: the last hidden group)")
    add_common_arguments(parser)


def run(args: argparse.Namespace, out: Path) -> list[Path]:
    check_positive_int("--samples-per-class", args.samples_per_class)
    if args.model_b is not None:
        check_model_path(args.model_b)
    first = run_or_fresh_model(args.model_a, "--model-a", args)
    groups = list(group_sizes(first.model))
    layer = args.layer if args.layer is not None else groups[-1]
    if layer not in groups:
        raise AnalysisError(f"--layer {layer!r} is not a hidden group of this model; allowed: {groups}")
    models = {"a": first}
    if args.model_b is not None:
        models["b"] = load_run_model(args.model_b)
        if models["b"].dataset.name != first.dataset.name:
            raise AnalysisError(f"model a is for '{first.dataset.name}', model b for '{models['b'].dataset.name}'")
    data = first.dataset
    prefs = {
        name: preference_vectors(
            m.model, data.test_x, data.test_y, data.num_classes, samples_per_class=args.samples_per_class
        )
        for name, m in models.items()
    }
    comparison = compare_preferences(prefs["a"], prefs["b"]) if "b" in prefs else None
    for group, matrix in prefs["a"].items():
        line = f"{group:<20} J={len(matrix):<5}"
        if comparison:
            line += f" same preferred class: {comparison[group].agreement:.3f} of {comparison[group].active} active"
        print(line)
    payload = {
        "tool": "preference-vectors",
        "models": {n: m.source for n, m in models.items()},
        "dataset": data.name,
        "samples_per_class": args.samples_per_class,
        "definition": "p_c = mean over class-c samples of A * dZ_c/dA (Eq. 2 of Fed2), rows L1-normalised",
        "preferences": prefs,
        "comparison": {g: asdict(c) for g, c in comparison.items()} if comparison else None,
    }
    plt = pyplot()
    fig, axes = plt.subplots(1, len(prefs), figsize=(4.5 * len(prefs), 6), squeeze=False)
    for ax, (name, matrix) in zip(axes[0], prefs.items()):
        image = ax.imshow(matrix[layer].numpy(), aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
        ax.set(xlabel="class", ylabel="unit", title=f"model {name}: {layer}")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    return save_outputs(out, "preference-vectors", payload, fig)


COMMAND = Subcommand(
    name="preference-vectors",
    summary="class preference vectors per hidden unit (Fed2 Eq. 2) and same-class agreement of two models",
    description=__doc__,
    add_arguments=add_arguments,
    run=run,
)
