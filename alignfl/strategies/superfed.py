"""SuPerFed: a personal model connected to the federated one.

Hahn, Jeong and Lee, "Connecting Low-Loss Subspace for Personalized Federated Learning",
KDD 2022.

Each client keeps a local model w_l (same architecture, its own Xavier-normal
initialisation seeded by the partition id) in ``context.state``; it never leaves
the client. From round ⌊superfed-start · num-server-rounds⌋ on, every mini-batch
draws λ ~ U(0, 1) — one for the model (``mm``) or one per layer (``lm``) — and
trains the point W(λ) = (1 − λ)·w_f + λ·w_l of the segment between the received
federated model w_f and w_l with

    CE(W(λ)) + μ · Σ_layers ‖w_f − w_g‖₂ + ν · cos²(w_f, w_l)

(the authors' code: unsquared L2 norm per mixed layer; cosine over all mixed
parameters flattened together). The mixed weights are formed as tensors of w_f's
and w_l's leaves and fed to the network with :func:`torch.func.functional_call`,
so one backward pass reaches both endpoints and no module is rewritten. Before
the start round only w_f trains (λ = 0, w_l frozen, no cosine term: it would only
push w_f away from a random vector): FedAvg when μ = 0, the reference's FedProx
otherwise. The server is FedAvg: only w_f travels, averaged by example count.

BatchNorm buffers (running mean/var) belong to the federated model: the mixed
network's batches update them during training and they travel with w_f as in
FedAvg. For evaluation at a given λ they are re-estimated on the client's training
data (as Wortsman et al., "Learning Neural Network Subspaces", ICML 2021, does for every point of a line),
because W(λ)'s activations follow neither endpoint's statistics.

A ``superfed-val-fraction`` part of each client's training split is held out from
training, to choose λ honestly; the paper's per-client best λ on the test split is
reported too, labelled ``oracle``. (The reply's example count is still the whole
training split, as for every strategy; with equal fractions the weights are the same.)
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord
from torch import nn
from torch.func import functional_call

from alignfl.core.config import RunConfig
from alignfl.core.data import ClientData
from alignfl.core.metrics.calibration import classification_scores
from alignfl.core.rounds.replies import CONFIG_RECORD
from alignfl.core.rounds.strategy import ServerStrategy
from alignfl.core.training.sgd import PlainSGD, iterate_batches
from alignfl.plugins.options import choice, non_negative, option
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm

SUPERFED_MODES = ("mm", "lm")
LOCAL_INITS = ("seeded", "authors")
LAMBDA_GRID = tuple(i / 10 for i in range(11))
LOCAL_MODEL = "superfed-local-model"
"""``context.state`` ArrayRecord: the local model's parameters."""
LOCAL_INFO = "superfed-local-info"
"""``context.state`` MetricRecord: ``mixing-rounds``, how many rounds trained the local model."""


@dataclass(frozen=True)
class SuPerFedSettings:
    superfed_mode: str = choice(
        "mm", "model mixing (mm: one lambda per batch) or layer mixing (lm: one per layer)", SUPERFED_MODES
    )
    superfed_nu: float = option(
        1.0, "weight of the connectivity regulariser cos^2(w_f, w_l)", non_negative, "must be a finite number >= 0"
    )
    superfed_mu: float = option(0.01, "weight of the proximal term", non_negative, "must be a finite number >= 0")
    superfed_start: float = option(
        0.5,
        "share of num-server-rounds before mixing starts",
        lambda v: 0 <= v <= 1,
        "must lie in [0, 1] (the fraction of num-server-rounds before mixing starts)",
    )
    superfed_val_fraction: float = option(
        0.1,
        "share of each client's training data held out to choose lambda honestly (0: none, and no honest-* figures)",
        lambda v: 0 <= v < 1,
        "must lie in [0, 1)",
    )
    superfed_local_init: str = choice(
        "seeded",
        "how the local model starts: seeded (by run seed and client) or "
        "authors (every weight from a stream seeded by the client id, as the "
        "authors' code)",
        LOCAL_INITS,
    )


def start_round(config: RunConfig) -> int:
    """⌊L·R⌋: the first round that mixes (rounds count from 1, so 0 and 1 both mean 'from the start')."""
    return math.floor(config.settings.superfed_start * config.num_server_rounds)


def layer_groups(model: nn.Module) -> list[list[str]]:
    """Parameter names grouped by the module that owns them (a layer's weight and bias share one λ)."""
    groups: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        groups.setdefault(name.rpartition(".")[0], []).append(name)
    return list(groups.values())


def initial_local_model(
    model: nn.Module, seed: int, partition_id: int, init: str = "seeded"
) -> dict[str, torch.Tensor]:
    """w_l's first parameters: Xavier-normal weights, zero biases, unit scales for 1-D weights (normalisation
    layers). ``seeded``: one random stream seeded by (run seed, partition id), so runs with other seeds draw other
    local models. ``authors``: as the authors' code, every weight drawn from a stream freshly seeded with the
    client id alone (each layer restarts it), whatever the run's seed."""
    stream = int(np.random.SeedSequence([seed, partition_id, 0x10CA1]).generate_state(1, np.uint64)[0] >> 1)
    generator = torch.Generator().manual_seed(stream)
    local = {}
    for name, param in model.named_parameters():
        tensor = torch.empty(param.shape, dtype=param.dtype)
        if param.dim() >= 2:
            if init == "authors":
                generator = torch.Generator().manual_seed(partition_id)
            nn.init.xavier_normal_(tensor, generator=generator)
        elif name.endswith("weight"):
            nn.init.ones_(tensor)
        else:
            nn.init.zeros_(tensor)
        local[name] = tensor.to(param.device)
    return local


def mixed_parameters(
    federated: dict[str, torch.Tensor], local: dict[str, torch.Tensor], groups: list[list[str]], lambdas: list[float]
) -> dict[str, torch.Tensor]:
    """W(λ) = (1 − λ)·w_f + λ·w_l, with ``lambdas[g]`` for every parameter of group ``g``."""
    return {
        name: (1.0 - lam) * federated[name] + lam * local[name]
        for group, lam in zip(groups, lambdas, strict=True)
        for name in group
    }


def proximal_term(
    federated: dict[str, torch.Tensor], global_: dict[str, torch.Tensor], groups: list[list[str]]
) -> torch.Tensor:
    """Σ over layers of the unsquared L2 norm ‖w_f − w_g‖₂ (the layer's parameters flattened together)."""
    return sum(
        torch.linalg.vector_norm(torch.cat([(federated[n] - global_[n]).flatten() for n in group])) for group in groups
    )


def squared_cosine(federated: dict[str, torch.Tensor], local: dict[str, torch.Tensor]) -> torch.Tensor:
    """cos²(w_f, w_l) over all mixed parameters flattened into one vector each."""
    f = torch.cat([t.flatten() for t in federated.values()])
    l = torch.cat([local[name].flatten() for name in federated])
    return (torch.dot(f, l) / (torch.linalg.vector_norm(f) * torch.linalg.vector_norm(l))).pow(2)


def _load_local(update: LocalUpdate, model: nn.Module, partition_id: int) -> tuple[dict[str, torch.Tensor], int]:
    """The stored local model and its count of mixing rounds, or a fresh one and 0."""
    device = next(model.parameters()).device
    stored = update.context.state.get(LOCAL_MODEL)
    if stored is None:
        return initial_local_model(model, update.config.seed, partition_id, update.settings.superfed_local_init), 0
    local = {name: tensor.to(device) for name, tensor in stored.to_torch_state_dict().items()}
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if {name: tuple(t.shape) for name, t in local.items()} != expected:
        raise ValueError(
            "the stored SuPerFed local model does not fit this run's model; a node keeps one local model per run"
        )
    return local, int(update.context.state[LOCAL_INFO]["mixing-rounds"])


def validation_split(n: int, fraction: float, seed: int, partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) positions in a client's training split; the same in every round and process."""
    order = torch.as_tensor(np.random.default_rng([seed, partition_id, 0x7A1]).permutation(n))
    num_val = min(round(n * fraction), max(n - 1, 0))
    return order[num_val:].sort().values, order[:num_val].sort().values


class SuPerFedUpdate(LocalUpdate):
    """One round of SuPerFed local training; personalised evaluation over the λ grid."""

    not_vectorised = "every step mixes two models with a λ drawn at random, per client"

    def _partition_id(self) -> int:
        return int(self.context.node_config["partition-id"])

    def begin(self, model: nn.Module) -> None:
        server_round = int(self.received[CONFIG_RECORD]["server-round"])
        partition_id = self._partition_id()
        self.mixing = server_round >= start_round(self.config)
        self.groups = layer_groups(model)
        self.global_params = {n: p.detach().clone() for n, p in model.named_parameters()}
        local, self.mixing_rounds = _load_local(self, model, partition_id)
        self.local = {n: t.detach().clone().requires_grad_(self.mixing) for n, t in local.items()}
        self.local_norm_in = float(torch.linalg.vector_norm(torch.cat([t.flatten() for t in local.values()])))
        state = np.random.SeedSequence([self.config.seed, server_round, partition_id, 0x1A3DA])
        self.lambda_generator = torch.Generator().manual_seed(int(state.generate_state(1, np.uint64)[0] >> 1))

    def draw_lambdas(self) -> list[float]:
        """λ ~ U(0, 1) for this mini-batch: one for every layer (``mm``) or one per layer (``lm``)."""
        count = 1 if self.settings.superfed_mode == "mm" else len(self.groups)
        draws = torch.rand(count, generator=self.lambda_generator, dtype=torch.float64).tolist()
        return draws * len(self.groups) if count == 1 else draws

    def optimizer(self, model: nn.Module) -> PlainSGD:
        """One SGD over both endpoints (w_l only once mixing has started), this round's lr, momentum, decay."""
        return self.sgd(list(model.parameters()) + (list(self.local.values()) if self.mixing else []))

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        federated = dict(model.named_parameters())
        if self.mixing:
            params = mixed_parameters(federated, self.local, self.groups, self.draw_lambdas())
            objective = nn.functional.cross_entropy(functional_call(model, params, (x,)), y)
            if self.settings.superfed_nu > 0.0:
                objective = objective + self.settings.superfed_nu * squared_cosine(federated, self.local)
        else:
            objective = nn.functional.cross_entropy(model(x), y)
        if self.settings.superfed_mu > 0.0:
            objective = objective + self.settings.superfed_mu * proximal_term(
                federated, self.global_params, self.groups
            )
        return objective

    def train(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator, device: torch.device
    ) -> dict[str, float]:
        """Train on the split minus its validation part; keep w_l in ``context.state``; report how far it got."""
        keep, _ = validation_split(len(y), self.settings.superfed_val_fraction, self.config.seed, self._partition_id())
        metrics = super().train(model, x[keep], y[keep], generator, device)
        if self.mixing:
            self.mixing_rounds += 1
            self.context.state[LOCAL_MODEL] = ArrayRecord({n: t.detach().cpu() for n, t in self.local.items()})
            self.context.state[LOCAL_INFO] = MetricRecord({"mixing-rounds": self.mixing_rounds})
        with torch.no_grad():
            local_norm = torch.linalg.vector_norm(torch.cat([t.flatten() for t in self.local.values()]))
            cosine = squared_cosine(dict(model.named_parameters()), self.local).sqrt()
        return {
            **metrics,
            "superfed-mixing": int(self.mixing),
            "superfed-local-rounds": self.mixing_rounds,
            "superfed-local-norm-in": self.local_norm_in,
            "superfed-local-norm-out": float(local_norm),
            "superfed-abs-cosine": float(cosine),
        }

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: ClientData, device: torch.device) -> dict[str, Any]:
        """Accuracy, ECE and MCE of W(λ) for λ in the grid on the local test split; the oracle λ (best on
        the test split) and the honest λ (best on the held-out validation part of the training split)."""
        partition_id = self._partition_id()
        local, mixing_rounds = _load_local(self, model, partition_id)
        _, val = validation_split(
            len(data.train_y), self.settings.superfed_val_fraction, self.config.seed, partition_id
        )
        federated = {n: p.detach() for n, p in model.named_parameters()}
        groups = layer_groups(model)
        point = copy.deepcopy(model)
        has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in point.modules())
        test, valid = [], []
        for lam in LAMBDA_GRID:
            for name, tensor in mixed_parameters(federated, local, groups, [lam] * len(groups)).items():
                point.get_parameter(name).copy_(tensor)
            if has_batchnorm and lam > 0.0:  # W(0) is the received global model, buffers included
                recalibrate_batchnorm(point, data.train_x, device, self.config.batch_size)
            test.append(classification_scores(point, data.test_x, data.test_y, device))
            valid.append(classification_scores(point, data.train_x[val], data.train_y[val], device))
        accuracy = [s[0] for s in test]
        oracle = _best(accuracy)
        chosen = {"oracle": oracle}
        if len(val):  # with superfed-val-fraction 0 there is no honest choice to report
            chosen["honest"] = _best([s[0] for s in valid])
        picked = {
            f"{label}-{metric}": (test[i][column] if i is not None else math.nan)
            for label, i in chosen.items()
            for column, metric in enumerate(("accuracy", "ece", "mce"))
        }
        lambdas = {f"{label}-lambda": (LAMBDA_GRID[i] if i is not None else math.nan) for label, i in chosen.items()}
        return {
            "local-loss": test[0][3],
            "local-accuracy": accuracy[0],
            "local-ece": test[0][1],
            "local-mce": test[0][2],
            "lambda-accuracy": accuracy,
            "lambda-ece": [s[1] for s in test],
            "lambda-mce": [s[2] for s in test],
            **picked,
            **lambdas,
            "superfed-local-trained": int(mixing_rounds > 0),
        }


def _best(accuracies: list[float]) -> int | None:
    """Index of the highest accuracy (the smallest λ among ties); None when nothing was scored."""
    finite = [(a, -i) for i, a in enumerate(accuracies) if not math.isnan(a)]
    return -max(finite)[1] if finite else None


def recalibrate_batchnorm(model: nn.Module, x: torch.Tensor, device: torch.device, batch_size: int) -> None:
    """Re-estimate BatchNorm running statistics as the plain average over one pass of ``x``."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average
    model.train()
    for xb, _ in iterate_batches(x, x.new_zeros(len(x)), batch_size):
        model(xb.to(device))
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum


STRATEGIES.register(
    Algorithm(
        "superfed",
        ServerStrategy,
        SuPerFedUpdate,
        "SuPerFed: a local model mixed with the federated one (superfed-mode mm/lm); the server averages w_f as FedAvg",
        SuPerFedSettings,
        paper="Hahn, Jeong and Lee, Connecting Low-Loss Subspace for Personalized Federated Learning, KDD 2022",
    )
)
