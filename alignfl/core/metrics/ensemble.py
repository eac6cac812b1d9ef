"""Scoring several models of one network on one test split: each on its own and as an ensemble.

The ensemble (the mean of the models' softmax outputs) is the upper reference of one-shot merging: what the
clients' models reach together without being fused into one network; the gap between it and the merged model
is the merge's "barrier" (Singh and Jaggi, "Model Fusion via Optimal Transport", NeurIPS 2020, report it beside
every fusion).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord
from torch import nn

from alignfl.core.model_io import load_arrays
from alignfl.core.training.sgd import iterate_batches


@dataclass(frozen=True)
class EnsembleScores:
    """Test accuracy of the ensemble and of each model, in the order given."""

    ensemble: float
    models: list[float]

    def metrics(self) -> dict[str, float]:
        """A round's ``server-*`` entries: the ensemble, the best single model and the models' mean."""
        return {
            "server-ensemble": self.ensemble,
            "server-best-client": max(self.models),
            "server-client-mean": sum(self.models) / len(self.models),
        }


@torch.no_grad()
def _probabilities(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> torch.Tensor:
    model.eval()
    return torch.cat([torch.softmax(model(xb.to(device)), dim=1).cpu() for xb, _ in iterate_batches(x, y, 1024)])


def score_models(
    model: nn.Module, arrays: Sequence[ArrayRecord], x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> EnsembleScores:
    """Load each of ``arrays`` into ``model`` (it takes their widths) and score it on (x, y); the ensemble is the
    unweighted mean of their softmax outputs. ``model`` is left holding the last of them."""
    if not arrays:
        raise ValueError("score_models needs at least one model")
    total = torch.zeros(0)
    accuracies = []
    for record in arrays:
        load_arrays(model, record)
        probabilities = _probabilities(model, x, y, device)
        total = probabilities if total.numel() == 0 else total + probabilities
        accuracies.append((probabilities.argmax(dim=1) == y).double().mean().item())
    return EnsembleScores((total.argmax(dim=1) == y).double().mean().item(), accuracies)
