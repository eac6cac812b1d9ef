"""MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021): model-contrastive local training.

Each mini-batch adds μ·ℓ_con to the cross-entropy, with
ℓ_con = −log(e^{sim(z, z_glob)/τ} / (e^{sim(z, z_glob)/τ} + e^{sim(z, z_prev)/τ})),
sim the cosine similarity and z, z_glob, z_prev the representations of the
batch under the local model being trained, the (frozen) global model received
this round and the client's own model from the end of its previous round. That
previous model lives in ``context.state`` as an ArrayRecord. The server is plain
FedAvg.

Settings: ``moon-mu`` (μ, default 1) and ``moon-tau`` (τ, default 0.5). The
paper tunes μ over {0.1, 1, 5, 10} and reports 5 best for CIFAR-10 and 1 for
CIFAR-100 and Tiny-ImageNet, with τ = 0.5 (§4.1); the authors' code defaults to
μ = 1, τ = 0.5. μ = 1 is the default here since most of this project's data sets
are not CIFAR-10; set ``moon-mu=5`` to follow the paper on CIFAR-10.

Where this differs from the paper, and why:

* The representation is the model's penultimate features
  (``model.representation(x)``, the classifier's input). The paper adds a
  projection head (two linear layers, 256 outputs) and contrasts its output;
  that would add layers to every network and to its permutation spec.
* In a client's first round there is no previous model, so the term is left
  out (μ·0). Using the global model as the negative instead would give
  ℓ_con = log 2 whatever z is, with zero gradient, so the two are the same update.
* The frozen global and previous models run in eval mode (BatchNorm uses its
  running statistics and the copies' statistics stay untouched).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from alignfl.core.model_io import load_arrays, to_arrays
from alignfl.core.rounds.strategy import ServerStrategy
from alignfl.plugins.options import non_negative, option, positive
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm

STATE_KEY = "moon-previous-model"
"""Where a client keeps its last local model in ``context.state``."""


@dataclass(frozen=True)
class MoonSettings:
    moon_mu: float = option(1.0, "weight of the model-contrastive loss", non_negative, "must be a finite number >= 0")
    moon_tau: float = option(0.5, "temperature of the model-contrastive loss", positive, "must be a finite number > 0")


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's ℓ_con, averaged over the batch: the global representation is the positive, the previous one the
    negative. Written as cross-entropy over the two similarities, which is the same quantity, computed stably."""
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1)], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def _frozen(model: nn.Module) -> nn.Module:
    """A copy that takes no gradient and runs in eval mode."""
    frozen = copy.deepcopy(model).eval()
    for parameter in frozen.parameters():
        parameter.grad = None
        parameter.requires_grad_(False)
    return frozen


class MoonUpdate(LocalUpdate):
    """Local SGD on cross-entropy + μ·ℓ_con; keeps the trained model for the next round's negative."""

    not_vectorised = "its contrastive term runs the global and the client's previous model (three forward passes)"

    def begin(self, model: nn.Module) -> None:
        self.global_model = _frozen(model)
        self.previous_model: nn.Module | None = None
        stored = self.context.state.get(STATE_KEY)
        if stored is not None:
            self.previous_model = _frozen(model)
            load_arrays(self.previous_model, stored)
        self.contrastive_total, self.batches = 0.0, 0

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = model.representation(x)
        cross_entropy = F.cross_entropy(model.classifier(z), y)
        if self.previous_model is None:
            return cross_entropy
        with torch.no_grad():
            z_glob, z_prev = self.global_model.representation(x), self.previous_model.representation(x)
        contrastive = contrastive_loss(z, z_glob, z_prev, self.settings.moon_tau)
        self.contrastive_total, self.batches = self.contrastive_total + contrastive.item(), self.batches + 1
        return cross_entropy + self.settings.moon_mu * contrastive

    def train(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        generator: torch.Generator,
        device: torch.device,
    ) -> dict[str, float]:
        """Train, then keep the local model in ``context.state`` as the next round's negative."""
        metrics = super().train(model, x, y, generator, device)
        had_previous = self.previous_model is not None
        self.context.state[STATE_KEY] = to_arrays(model)
        return {
            **metrics,
            "has-previous-model": float(had_previous),
            "contrastive-loss": self.contrastive_total / self.batches if self.batches else 0.0,
        }


STRATEGIES.register(
    Algorithm(
        "moon",
        ServerStrategy,
        MoonUpdate,
        "model-contrastive local loss against the global and previous models (moon-mu, moon-tau); the server is FedAvg",
        MoonSettings,
        paper="Li, He and Song, Model-Contrastive Federated Learning, CVPR 2021",
    )
)
