"""Matching ratio: how many hidden units of a local model still sit at their global index.

PANs paper (Li et al., "Federated Learning with Position-Aware Neurons", CVPR 2022), Supp. E "Matching via
Optimal Assignment": feed ``m`` test samples (500 there) through a global and a local model, represent each unit by its
activations, solve the optimal assignment between the two models' units, and report the
fraction of units assigned to their own index. The paper notes this is an approximate
measure of how many units moved, not the exact permutation.

* Activations: each group's units after the PAN and the non-linearity (and any
  pooling before the next layer), read from the input of the layer that consumes the
  group (see :mod:`alignfl.fl_app.analysis.units`). A unit's vector holds its value for every
  sample and, for channels, every spatial position.
* Cost: ``-corr(a_i, b_j)``, the negative Pearson correlation between global unit ``i``
  and local unit ``j``, solved with ``scipy.optimize.linear_sum_assignment``.
  Correlation rather than a distance because it ignores each unit's offset and scale:
  local training (and multiplicative PANs) rescale units without changing what they
  respond to, which a Euclidean distance would count as a different unit.
* Statistics are accumulated batch by batch in float64 (sums, sums of squares and the
  ``J x J`` cross products), so memory does not grow with ``m`` or the image size.
* Ties: units the data cannot tell apart (a dead ReLU unit, constant over the samples,
  has correlation 0 with everything; two sparse units firing on the same single sample
  are perfectly correlated) make several assignments optimal. Among them the one that
  keeps units at their own index wins (a ``1e-9`` bonus on the diagonal): no evidence
  of movement counts as no movement, so identical models give exactly 1. Constant
  units are reported as ``inactive`` and ``ratio_active`` leaves the global model's
  constant units out.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from alignfl.fl_app.analysis.common import (
    AnalysisError,
    Subcommand,
    add_common_arguments,
    add_fresh_model_arguments,
    check_model_path,
    check_positive_int,
    check_unit_interval,
    load_run_model,
    pyplot,
    run_or_fresh_model,
    save_outputs,
    select_samples,
)
from alignfl.fl_app.analysis.shuffle import draw_permutations, kept_ratio, permuted_copy
from alignfl.fl_app.analysis.units import capture_units, group_sizes

DEFAULT_SAMPLES = 500
# Far above float64 rounding of a correlation (~1e-13), far below any real difference.
TIE_BREAK = 1e-9


@dataclass(frozen=True)
class GroupMatch:
    """The assignment of one group's units.

    ``ratio``: fraction of all ``units`` assigned to their own index; ``ratio_active``:
    the same over the units active (non-constant) in the global model, whose
    assignment means something; ``inactive``: units constant in either model.
    """

    units: int
    ratio: float
    ratio_active: float
    inactive: int
    mean_matched_correlation: float


class _CorrelationStats:
    """Running sums for the Pearson correlation between two sets of ``J`` unit activations."""

    def __init__(self, units: int) -> None:
        self.count = 0
        self.sum_a, self.sum_b, self.sq_a, self.sq_b = torch.zeros(4, units, dtype=torch.float64)
        self.cross = torch.zeros(units, units, dtype=torch.float64)

    def add(self, a: Tensor, b: Tensor) -> None:
        """``a``, ``b``: ``(N, J, S)`` activations of the same inputs; every (sample, position) is an observation."""
        rows_a = a.detach().double().permute(0, 2, 1).reshape(-1, a.shape[1])
        rows_b = b.detach().double().permute(0, 2, 1).reshape(-1, b.shape[1])
        self.count += rows_a.shape[0]
        self.sum_a += rows_a.sum(0)
        self.sum_b += rows_b.sum(0)
        self.sq_a += rows_a.square().sum(0)
        self.sq_b += rows_b.square().sum(0)
        self.cross += rows_a.T @ rows_b

    def correlation(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(J x J)`` correlations (0 where a unit is constant) and the masks of constant units of a and of b."""
        mean_a, mean_b = self.sum_a / self.count, self.sum_b / self.count
        std_a = (self.sq_a / self.count - mean_a.square()).clamp_min(0).sqrt()
        std_b = (self.sq_b / self.count - mean_b.square()).clamp_min(0).sqrt()
        flat_a, flat_b = _constant(std_a, mean_a), _constant(std_b, mean_b)
        covariance = self.cross / self.count - torch.outer(mean_a, mean_b)
        corr = covariance / torch.outer(std_a.where(~flat_a, 1.0), std_b.where(~flat_b, 1.0))
        corr[flat_a, :] = 0.0
        corr[:, flat_b] = 0.0
        return corr, flat_a, flat_b


def _constant(std: Tensor, mean: Tensor) -> Tensor:
    """Units whose spread is zero up to float64 rounding of their mean."""
    return std <= 1e-7 * mean.abs()


@torch.no_grad()
def matching_ratio(
    global_model: nn.Module, local_model: nn.Module, x: Tensor, batch_size: int = 256
) -> dict[str, GroupMatch]:
    """Per group: the fraction of units the optimal assignment maps to their own index.

    Both models must share one architecture; ``x`` are the ``m`` samples.
    """
    sizes = dict(group_sizes(global_model))
    if dict(group_sizes(local_model)) != sizes:
        raise AnalysisError(f"the two models have different hidden groups: {sizes} vs {dict(group_sizes(local_model))}")
    check_positive_int("number of samples m", len(x))
    stats = {group: _CorrelationStats(units) for group, units in sizes.items()}
    global_model.eval()
    local_model.eval()
    with capture_units(global_model) as acts_global, capture_units(local_model) as acts_local:
        for batch in x.split(check_positive_int("batch_size", batch_size)):
            global_model(batch)
            local_model(batch)
            for group, accumulator in stats.items():
                accumulator.add(acts_global[group], acts_local[group])
    return {group: _assign(accumulator) for group, accumulator in stats.items()}


def _assign(stats: _CorrelationStats) -> GroupMatch:
    corr, flat_a, flat_b = stats.correlation()
    preference = corr.numpy() + TIE_BREAK * np.eye(len(corr))
    rows, cols = linear_sum_assignment(preference, maximize=True)
    own = cols == rows
    active = ~flat_a.numpy()
    return GroupMatch(
        units=len(rows),
        ratio=float(own.mean()),
        ratio_active=float(own[active].mean()) if active.any() else float("nan"),
        inactive=int((flat_a | flat_b).sum()),
        mean_matched_correlation=float(corr.numpy()[rows, cols].mean()),
    )


# --- command line -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--global-model", help="global model: run folder or model.pt (with config.json beside it)")
    add_fresh_model_arguments(parser, with_pan=True)
    parser.add_argument(
        "--local-model",
        help="local model: run folder or model.pt; default: the global model "
        "shuffled with Alg. 1 at --p-sf (a self-check: with PANs off the ratio equals R_kept)",
    )
    parser.add_argument(
        "--p-sf", type=float, default=0.5, help="without --local-model: P_sf of the shuffle (default 0.5)"
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=DEFAULT_SAMPLES,
        help=f"m, test samples fed to both models (default {DEFAULT_SAMPLES}; capped at the test size)",
    )
    add_common_arguments(parser)


def run(args: argparse.Namespace, out: Path) -> list[Path]:
    check_positive_int("--samples", args.samples)
    check_unit_interval("--p-sf", args.p_sf)
    if args.local_model is not None:
        check_model_path(args.local_model)
    glob = run_or_fresh_model(args.global_model, "--global-model", args)
    kept = None
    if args.local_model is not None:
        local = load_run_model(args.local_model)
        if local.dataset.name != glob.dataset.name:
            raise AnalysisError(f"global model is for '{glob.dataset.name}', local for '{local.dataset.name}'")
        local_model, local_source = local.model, local.source
    else:
        perms = draw_permutations(glob.model, args.p_sf, 1, args.seed)[0]
        local_model, local_source = permuted_copy(glob.model, perms), f"global shuffled, P_sf={args.p_sf:g}"
        kept = {group: kept_ratio({group: perm}) for group, perm in perms.items()}
    x, _ = select_samples(glob.dataset.test_x, glob.dataset.test_y, args.samples, args.seed)
    result = matching_ratio(glob.model, local_model, x)
    for group, match in result.items():
        extra = f" (R_kept {kept[group]:.3f})" if kept else ""
        print(
            f"{group:<20} J={match.units:<5} matching ratio {match.ratio:.3f}{extra}, "
            f"over active units {match.ratio_active:.3f}, inactive {match.inactive}"
        )
    payload = {
        "tool": "matching-ratio",
        "global": glob.source,
        "local": local_source,
        "dataset": glob.dataset.name,
        "samples": len(x),
        "cost": "-Pearson correlation of post-PAN, post-ReLU activations",
        "groups": {group: asdict(match) for group, match in result.items()},
        "shuffle_r_kept": kept,
    }
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(result)), 4))
    ax.bar(range(len(result)), [m.ratio for m in result.values()], label="matching ratio")
    if kept:
        ax.plot(range(len(kept)), list(kept.values()), "k_", markersize=18, label="R_kept of the shuffle")
        ax.legend()
    ax.set_xticks(range(len(result)), list(result), rotation=60, ha="right", fontsize=7)
    ax.set(ylim=(0, 1.05), ylabel="units assigned to their own index", title=f"matching ratio, m = {len(x)}")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return save_outputs(out, "matching-ratio", payload, fig)


COMMAND = Subcommand(
    name="matching-ratio",
    summary="fraction of hidden units the optimal assignment (Hungarian) keeps at their index",
    description=__doc__,
    add_arguments=add_arguments,
    run=run,
)
