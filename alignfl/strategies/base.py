"""What every algorithm's client shares: the local SGD loop, and the hooks an algorithm changes."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from alignfl.core.config import RunConfig
from alignfl.core.data import ClientData
from alignfl.core.metrics.calibration import classification_scores
from alignfl.core.model_io import to_arrays
from alignfl.core.rounds.replies import CONFIG_RECORD
from alignfl.core.training.sgd import PlainSGD, iterate_batches

SEQUENTIAL_HOOKS = ("train", "loss", "after_backward", "optimizer", "sgd")
"""Hooks of the sequential update that a stacked update (:mod:`alignfl.core.training.vectorised`) does not call."""


class LocalUpdate:
    """FedAvg's client: ``local-epochs`` of SGD on cross-entropy from the received global model.

    Algorithms subclass it to add loss terms (:meth:`loss`), to prepare from the
    global model (:meth:`begin`), to change gradients before each step
    (:meth:`after_backward`), to read what else the server sent (``received``: the
    training message's content, ``"arrays"``, ``"config"`` and any record the
    strategy's server adds), to send more than the model back
    (:meth:`reply_records`) or only part of the model (:meth:`model_record`), or to
    keep state across rounds in ``context.state``.
    """

    not_vectorised: ClassVar[str | None] = None
    """Why this update cannot train many clients at once (:mod:`alignfl.core.training.vectorised`), or None when it can:
    its steps are then cross-entropy plus :meth:`proximal_mu`'s term, the gradient plus :meth:`gradient_correction`, and
    SGD over every parameter but the :meth:`frozen` ones, for :meth:`local_epochs`. A subclass that overrides a
    hook the stacked update does not call (:data:`SEQUENTIAL_HOOKS`) and does not set this itself is marked as not
    vectorised."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = [hook for hook in SEQUENTIAL_HOOKS if hook in cls.__dict__]
        if overridden and "not_vectorised" not in cls.__dict__:
            cls.not_vectorised = f"{cls.__name__} overrides {', '.join(overridden)}, which a stacked update never calls"

    def __init__(self, config: RunConfig, context: Context | None, received: RecordDict | None = None) -> None:
        self.config = config
        self.settings = config.settings
        """The algorithm's own settings (its settings class, from the run config)."""
        self.context = context
        self.received = received if received is not None else RecordDict()

    def begin(self, model: nn.Module) -> None:
        """Called after the global model is loaded, before the first step."""

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The objective of one mini-batch."""
        return nn.functional.cross_entropy(model(x), y)

    def proximal_mu(self) -> float:
        """μ of a proximal term μ/2·‖w − w_start‖² in the loss (``w_start``: the parameters after :meth:`begin`),
        0 for none. A subclass that returns μ > 0 adds the term in its :meth:`loss` (one client's steps, through
        autograd); the stacked update adds the term's gradient μ(w − w_start) itself."""
        return 0.0

    def gradient_correction(self) -> dict[str, torch.Tensor] | None:
        """Parameter name → a tensor added to every step's gradient (set by :meth:`begin`), or None."""
        return None

    def after_backward(self, model: nn.Module) -> None:
        """Called once per step, after the backward pass and before the optimizer step: adds
        :meth:`gradient_correction` (a parameter without a gradient gets the correction as its gradient)."""
        correction = self.gradient_correction()
        if correction is None:
            return
        for name, p in model.named_parameters():
            if p.grad is None:
                p.grad = correction[name].clone()
            else:
                p.grad.add_(correction[name])

    def frozen(self, model: nn.Module) -> frozenset[str]:
        """Names of the parameters this round's update leaves as received (after :meth:`begin`); the others train.
        FedMA's later stages freeze the layers matched so far."""
        return frozenset()

    def local_epochs(self) -> int:
        """This round's number of epochs over the client's training split (after :meth:`begin`)."""
        return self.config.local_epochs

    def learning_rate(self) -> float:
        """This round's client learning rate: lr · lr-decay^(r − 1) (SuPerFed's per-round decay), times
        min(1, r / lr-warmup-rounds) during a linear warm-up (the PANs authors' code); r is the training
        message's ``server-round``."""
        config = self.config
        if config.lr_decay == 1.0 and config.lr_warmup_rounds == 0:
            return config.lr
        server_round = self.received[CONFIG_RECORD].get("server-round") if CONFIG_RECORD in self.received else None
        if not isinstance(server_round, int) or server_round < 1:
            raise ValueError(
                f"lr-decay={config.lr_decay} and lr-warmup-rounds={config.lr_warmup_rounds} need the "
                f"training message's config to hold 'server-round' (an integer >= 1), got {server_round!r}"
            )
        warmup = min(1.0, server_round / config.lr_warmup_rounds) if config.lr_warmup_rounds else 1.0
        return config.lr * config.lr_decay ** (server_round - 1) * warmup

    def sgd(self, params: Iterable[torch.Tensor]) -> PlainSGD:
        """SGD over ``params`` with this round's learning rate (:meth:`learning_rate`), the run's momentum and
        weight decay."""
        return PlainSGD(params, self.learning_rate(), self.config.momentum, self.config.weight_decay)

    def optimizer(self, model: nn.Module) -> PlainSGD:
        """What trains: SGD over the model's parameters but the :meth:`frozen` ones (algorithms that train
        others override it)."""
        frozen = self.frozen(model)
        return self.sgd(p for name, p in model.named_parameters() if name not in frozen)

    def train(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        generator: torch.Generator,
        device: torch.device,
    ) -> dict[str, float]:
        """Run the local epochs; returns the mean training loss."""
        self.begin(model)
        optimizer = self.optimizer(model)
        names = self.frozen(model)
        frozen = [p for name, p in model.named_parameters() if name in names]
        for p in frozen:  # no gradient computed for what does not train
            p.requires_grad_(False)
        model.train()
        total, self.steps = 0.0, 0
        try:
            for _ in range(self.local_epochs()):
                for xb, yb in iterate_batches(x, y, self.config.batch_size, generator):
                    xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                    optimizer.zero_grad()
                    loss = self.loss(model, xb, yb)
                    loss.backward()
                    self.after_backward(model)
                    optimizer.step()
                    total, self.steps = total + loss.item(), self.steps + 1
        finally:
            for p in frozen:  # a client process reuses its model for the next message
                p.requires_grad_(True)
        return self.end(model, total)

    def end(self, model: nn.Module, total_loss: float) -> dict[str, float]:
        """Called after the last step (``model`` holds the trained state, :attr:`steps` the number of steps
        taken): the training metrics, from the sum of the steps' losses (in step order)."""
        return {"train-loss": total_loss / self.steps if self.steps else math.nan}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: ClientData, device: torch.device) -> dict[str, Any]:
        """The client's evaluate reply metrics for the received global ``model``: its loss and accuracy on
        the local test split of ``data``, with ECE and MCE (15 bins). Personalised algorithms override it to
        score their own models (the training split is there for what they need from it, e.g. a validation
        part); values may be lists of floats."""
        accuracy, ece, mce, loss = classification_scores(model, data.test_x, data.test_y, device)
        return {"local-loss": loss, "local-accuracy": accuracy, "local-ece": ece, "local-mce": mce}

    def model_record(self, model: nn.Module) -> ArrayRecord:
        """The model as sent back under ``"arrays"``: its whole federated state (a Ψ-Net client
        overrides this to send only the shared layers and the groups it trained)."""
        return to_arrays(model)

    def reply_records(self, data: ClientData) -> dict[str, ArrayRecord]:
        """ArrayRecords to send beside the model's ``"arrays"`` and the metrics; read after :meth:`train` (``data``:
        the client's data)."""
        return {}
