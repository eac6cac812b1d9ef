"""Calibration of a classifier's confidence: expected and maximum calibration error (ECE, MCE).

Predictions are binned by confidence (the top softmax probability) into ``bins``
equal-width intervals ``(b/B, (b+1)/B]``; a bin's gap is |accuracy − mean
confidence| inside it. ECE is the gap averaged with weights ``|bin| / n``; MCE is
the largest gap over non-empty bins (Guo et al., 2017; Naeini et al., 2015).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from alignfl.core.training.sgd import iterate_batches

CALIBRATION_BINS = 15


def calibration_errors(
    probabilities: torch.Tensor, labels: torch.Tensor, bins: int = CALIBRATION_BINS
) -> tuple[float, float]:
    """``(ECE, MCE)`` of class probabilities ``(n, C)`` against integer labels ``(n,)``; NaN for n = 0."""
    if len(labels) == 0:
        return math.nan, math.nan
    confidence, predicted = probabilities.max(dim=1)
    correct = (predicted == labels).double()
    # Bin b holds confidences in (b/bins, (b+1)/bins]; a confidence of exactly 0 cannot occur for a softmax.
    index = (torch.ceil(confidence.double() * bins).long() - 1).clamp(0, bins - 1)
    ece, mce = 0.0, 0.0
    for b in range(bins):
        members = index == b
        count = int(members.sum())
        if count:
            gap = abs(float(correct[members].mean()) - float(confidence[members].double().mean()))
            ece += count / len(labels) * gap
            mce = max(mce, gap)
    return ece, mce


@torch.no_grad()
def classification_scores(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> tuple[float, float, float, float]:
    """(accuracy, ECE, MCE, mean cross-entropy) of ``model`` on (x, y) in eval mode; NaNs when empty."""
    if len(y) == 0:
        return math.nan, math.nan, math.nan, math.nan
    model.eval()
    logits = torch.cat([model(xb.to(device)) for xb, _ in iterate_batches(x, y, 1024)]).cpu()
    ece, mce = calibration_errors(logits.softmax(dim=1), y)
    accuracy = float((logits.argmax(dim=1) == y).double().mean())
    return accuracy, ece, mce, float(nn.functional.cross_entropy(logits, y))
