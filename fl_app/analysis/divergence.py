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
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from fl_app.analysis.common import (
    AnalysisError,
    Subcommand,
    add_common_arguments,
    check_model_path,
    pyplot,
    read_state,
    save_outputs,
)


def weight_divergence(
    states: Sequence[Mapping[str, Tensor]], weights: Sequence[float] | None = None
) -> dict[str, float]:
    """Per state-dict key: weighted mean over clients of ``||W_k - mean W||^2``.

    Parameters
    ----------
    states : sequence of state dicts
        The clients' models (tensors; numpy arrays are accepted too). All must have
        the same floating-point keys and shapes.
    weights : sequence of float, optional
        One non-negative weight per client (e.g. example counts), not all zero;
        ``None`` weighs clients equally.

    Returns
    -------
    dict
        Key -> divergence, in the first state's key order, floating-point keys only.
    """
    if not states:
        raise AnalysisError("weight_divergence needs at least one state dict, got none")
    shares = _normalised(weights, len(states))
    first = states[0]
    keys = [key for key, value in first.items() if torch.is_floating_point(torch.as_tensor(value))]
    for index, state in enumerate(states[1:], start=1):
        _check_same_layout(first, state, keys, index)
    divergence: dict[str, float] = {}
    # Offsets from the most heavily weighted client: identical clients give exactly 0, and
    # clients close to each other lose no precision to the size of the weights themselves.
    origin_index = max(range(len(states)), key=shares.__getitem__)
    others = [(share, state) for index, (share, state) in enumerate(zip(shares, states)) if index != origin_index]
    for key in keys:
        origin = torch.as_tensor(states[origin_index][key])
        origin = origin.to(torch.promote_types(origin.dtype, torch.float32))
        mean_offset = torch.zeros_like(origin)
        for share, state in others:
            mean_offset.add_(torch.as_tensor(state[key]).to(origin.dtype) - origin, alpha=share)
        total = 0.0
        for share, state in zip(shares, states):
            deviation = (torch.as_tensor(state[key]).to(origin.dtype) - origin).sub_(mean_offset).reshape(-1)
            total += share * float(torch.dot(deviation, deviation))
        divergence[key] = total
    return divergence


def divergence_by_layer(per_key: Mapping[str, float]) -> dict[str, float]:
    """Sum per-key divergences by layer prefix (the key without its last ``.name``)."""
    layers: dict[str, float] = {}
    for key, value in per_key.items():
        prefix = key.rsplit(".", 1)[0]
        layers[prefix] = layers.get(prefix, 0.0) + value
    return layers


def _normalised(weights: Sequence[float] | None, count: int) -> list[float]:
    if weights is None:
        return [1.0 / count] * count
    values = [float(w) for w in weights]
    if len(values) != count:
        raise AnalysisError(f"weights: got {len(values)} for {count} models; give one per model")
    if any(not math.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
        raise AnalysisError(f"weights must be finite, >= 0 and not all zero, got {values}")
    total = sum(values)
    return [w / total for w in values]


def _check_same_layout(first: Mapping[str, Tensor], other: Mapping[str, Tensor], keys: list[str], index: int) -> None:
    missing = [key for key in keys if key not in other]
    extra = [key for key, value in other.items()
             if key not in first and torch.is_floating_point(torch.as_tensor(value))]
    if missing or extra:
        raise AnalysisError(f"state {index} differs from state 0: missing keys {missing[:5]}, extra keys {extra[:5]}")
    for key in keys:
        if tuple(other[key].shape) != tuple(first[key].shape):
            raise AnalysisError(f"state {index}: '{key}' has shape {tuple(other[key].shape)}, "
                                f"state 0 has {tuple(first[key].shape)}")


# --- command line -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", help="two or more run folders or model.pt files of the same network")
    parser.add_argument("--weights", type=float, nargs="+", default=None,
                        help="one weight per model, e.g. example counts (default: equal)")
    add_common_arguments(parser, seed=False)


def run(args: argparse.Namespace, out: Path) -> list[Path]:
    if len(args.models) < 2:
        raise AnalysisError(f"weight-divergence compares at least 2 models, got {len(args.models)}")
    _normalised(args.weights, len(args.models))
    paths = [check_model_path(path, require_config=False)[0] for path in args.models]
    per_key = weight_divergence([read_state(path) for path in paths], args.weights)
    per_layer = divergence_by_layer(per_key)
    for layer, value in per_layer.items():
        print(f"{layer:<32} {value:.6e}")
    payload = {"tool": "weight-divergence", "models": [str(p) for p in paths], "weights": args.weights,
               "definition": "weighted mean over models of ||W_k - mean W||^2 (squared Frobenius norm)",
               "per_key": per_key, "per_layer": per_layer, "total": sum(per_key.values())}
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
