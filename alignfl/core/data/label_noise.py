"""Synthetic label noise on clients' training labels (SuPerFed's robustness experiment, App. A.4).

Hahn, Jeong and Lee, "Connecting Low-Loss Subspace for Personalized Federated Learning", KDD 2022.

Only training labels are corrupted; clients' local test splits and the server's
test set keep their true labels. The corruption is a function of (seed,
partition id) alone, so every process and every round sees the same noisy
labels.

* ``pair`` (pairwise flipping): a flipped label of class ``i`` becomes ``(i + 1) mod C``
  (labellers confuse neighbouring classes).
* ``symmetric``: a flipped label becomes one of the other ``C − 1`` classes, uniformly.

Exactly ``round(rate · n)`` labels are flipped and every flipped label differs from
the true one, so the measured noise rate is the configured one (rather than a
binomial draw around it, or the ``rate·(C−1)/C`` that a transition matrix which may
redraw the true class gives).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

_Flip = Callable[[np.ndarray, int, np.random.Generator], np.ndarray]


def _pair(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    return (labels + 1) % num_classes


def _symmetric(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    return (labels + rng.integers(1, num_classes, size=len(labels))) % num_classes


_FLIPS: dict[str, _Flip | None] = {"none": None, "pair": _pair, "symmetric": _symmetric}
LABEL_NOISE_KINDS = tuple(_FLIPS)


def noisy_labels(
    labels: torch.Tensor, num_classes: int, kind: str, rate: float, seed: int, partition_id: int
) -> torch.Tensor:
    """A copy of ``labels`` with exactly ``round(rate · len(labels))`` of them flipped by rule ``kind``."""
    if kind not in _FLIPS:
        raise ValueError(f"label-noise '{kind}' is unknown; allowed: {list(LABEL_NOISE_KINDS)}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"label-noise-rate must lie in [0, 1), got {rate!r}")
    flip = _FLIPS[kind]
    if flip is None or rate == 0.0:
        return labels.clone()
    if num_classes < 2:
        raise ValueError(f"label noise needs at least 2 classes, got {num_classes}")
    rng = np.random.default_rng([seed, partition_id, 0x1AB])
    values = labels.cpu().numpy().astype(np.int64)
    chosen = rng.permutation(len(values))[: round(rate * len(values))]
    values[chosen] = flip(values[chosen], num_classes, rng)
    return torch.as_tensor(values, dtype=labels.dtype)
