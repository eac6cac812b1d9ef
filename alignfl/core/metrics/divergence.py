"""Weight divergence: how far clients' models spread around their weighted mean, per state-dict entry.

Written every round into ``metrics.jsonl`` when ``log-divergence`` is on, and read by the
``divergence`` analysis tool.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


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
        raise ValueError("weight_divergence needs at least one state dict, got none")
    shares = normalised_weights(weights, len(states))
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


def normalised_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    if weights is None:
        return [1.0 / count] * count
    values = [float(w) for w in weights]
    if len(values) != count:
        raise ValueError(f"weights: got {len(values)} for {count} models; give one per model")
    if any(not math.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {values}")
    total = sum(values)
    return [w / total for w in values]


def _check_same_layout(first: Mapping[str, Tensor], other: Mapping[str, Tensor], keys: list[str], index: int) -> None:
    missing = [key for key in keys if key not in other]
    extra = [
        key for key, value in other.items() if key not in first and torch.is_floating_point(torch.as_tensor(value))
    ]
    if missing or extra:
        raise ValueError(f"state {index} differs from state 0: missing keys {missing[:5]}, extra keys {extra[:5]}")
    for key in keys:
        if tuple(other[key].shape) != tuple(first[key].shape):
            raise ValueError(
                f"state {index}: '{key}' has shape {tuple(other[key].shape)}, state 0 has {tuple(first[key].shape)}"
            )
