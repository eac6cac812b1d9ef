"""SCAFFOLD: control variates correct each client's drift.

Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020.

The server keeps a control variate c, client i keeps its own c_i, both with the
model's shape. Every local gradient is corrected by (c − c_i); afterwards the
client sets c_i from its trajectory (the paper's option II) and sends Δc_i with
its model, and the server moves c by (1/N)·Σ Δc_i over the replies (N = nodes
connected). With c = c_i = 0 and ``scaffold-server-lr`` 1 a round is exactly FedAvg's.

Messages: a TRAIN message carries ``"arrays"`` (x), ``"config"`` and
``"control"`` (c); a reply carries ``"arrays"`` (the local model y_i),
``"control"`` (Δc_i = c_i⁺ − c_i) and ``"metrics"``. Both control records have
the keys and shapes of ``"arrays"``; entries that are not trainable parameters
(BatchNorm running statistics) have no gradient, so they stay zero.

Where this differs from the paper, and why:

* Local steps use the run's SGD with momentum and weight decay, like every other
  algorithm here (the paper uses plain SGD). The correction is added to the
  gradient before the optimizer step, so momentum carries it like any gradient.
  Option II's (x − y_i)/(K·η) then divides by :func:`momentum_step_sum` instead
  of K: with momentum β the K steps move the weights by η·Σ_k w_k·g_k, where
  Σ_k w_k is that sum, so the quotient stays a weighted mean of the corrected
  gradients and c_i⁺ a weighted mean of the raw ones, as option II intends.
  Dividing by K instead would inflate c_i about 1/(1 − β)-fold (10× at 0.9) and
  the control variates would diverge. For β = 0 the sum is K: the paper's rule.
  Weight decay is part of the gradient the optimizer follows, so it is part of
  c_i too.
* The model is averaged weighted by example counts (as FedAvg here) before the
  server step x + η_g·(ȳ − x) (η_g: ``scaffold-server-lr``); the paper takes the plain mean of Δy_i.
  c is updated with the plain mean, which keeps c the mean of all clients' c_i.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from alignfl.core.data import ClientData
from alignfl.core.model_io import arrays_mismatch, federated_state
from alignfl.core.rounds.nodes import NodeDirectory
from alignfl.core.rounds.replies import arrays_problem
from alignfl.core.rounds.strategy import Merge, Reply, RunContext, ServerStep, ServerStrategy, weighted_mean
from alignfl.plugins.options import option_from
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm


@dataclass(frozen=True)
class ScaffoldSettings:
    scaffold_server_lr: float = option_from(ServerStep, "server_lr")


CONTROL = "control"
"""Record name: the server's c in a TRAIN message, the client's Δc_i in its reply."""
STATE_KEY = "scaffold-control"
"""Where a client keeps its c_i in ``context.state`` between rounds."""


def momentum_step_sum(steps: int, momentum: float) -> float:
    """Σ_{k=1..K} (1 + β + … + β^(k−1)): how far, in units of η·g, K steps of PyTorch's SGD with
    momentum β (fresh buffer, no dampening) move the weights when every step sees the same gradient g.

    Step k's gradient stays in the momentum buffer for steps k..K, so it moves the weights by
    η·(1 + β + … + β^(K−k)); these weights sum to this value, which is K when β = 0.
    """
    return sum((1.0 - momentum**k) / (1.0 - momentum) for k in range(1, steps + 1))


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values()))) if tensors else 0.0


class Scaffold(ServerStrategy):
    """FedAvg that also sends c, collects Δc_i and applies the averaged model with ``scaffold-server-lr``."""

    extra_reply_arrays = (CONTROL,)
    state_keys = frozenset({"control"})

    def __init__(self, context: RunContext) -> None:
        super().__init__(context)
        self.control = ArrayRecord()  # c; zeros shaped like the model from the first round on
        self.num_nodes = 0  # N: nodes that may train, connected when the round was planned

    def plan_train(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        sample: Callable[[], list[int]],
        nodes: NodeDirectory,
    ) -> dict[int, RecordDict]:
        contents = super().plan_train(server_round, arrays, config, sample, nodes)
        self.num_nodes = len(nodes.trainable())
        if not len(self.control):
            self.control = ArrayRecord({key: Array(np.zeros_like(a.numpy())) for key, a in arrays.items()})
        for content in contents.values():
            content[CONTROL] = self.control
        return contents

    def reply_problem(self, content: RecordDict, reference: ArrayRecord) -> str | None:
        return super().reply_problem(content, reference) or arrays_problem(content[CONTROL], reference, CONTROL)

    def state_dict(self) -> dict[str, Any]:
        """The server's control variate c (the clients' c_i stay on the nodes, in ``context.state``)."""
        return {"control": self.control.to_torch_state_dict()} if len(self.control) else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state(state)
        self.control = ArrayRecord(dict(state["control"])) if "control" in state else ArrayRecord()

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge:
        average = weighted_mean(replies)
        updates = [reply.content[CONTROL] for reply in replies]
        clients = max(self.num_nodes, len(updates))
        self.control = ArrayRecord(
            {
                key: Array(np.asarray(c.numpy() + sum(update[key].numpy() for update in updates) / clients))
                for key, c in self.control.items()
            }
        )
        lr = self.settings.scaffold_server_lr
        return Merge(
            ArrayRecord(
                {
                    key: Array(np.asarray(x.numpy() + lr * (average[key].numpy() - x.numpy())))
                    for key, x in reference.items()
                }
            )
        )


class ScaffoldUpdate(LocalUpdate):
    """Local SGD with every gradient corrected by (c − c_i); then c_i⁺ from the trajectory (option II).

    It vectorises: the correction is constant over a client's round (:meth:`gradient_correction`) and c_i⁺
    is computed from the trained model and the number of steps (:meth:`end`)."""

    not_vectorised = None

    def begin(self, model: nn.Module) -> None:
        if CONTROL not in self.received.array_records:
            raise ValueError(
                f"the training message has no '{CONTROL}' record (it holds "
                f"{sorted(self.received)}); run the server with strategy=scaffold too"
            )
        problem = arrays_mismatch(federated_state(model), self.received[CONTROL])
        if problem is not None:
            raise ValueError(f"the server's control variate does not fit the model: {problem}")
        server = self.received[CONTROL].to_torch_state_dict()
        stored = self.context.state.get(STATE_KEY)
        local = stored.to_torch_state_dict() if stored is not None else {}
        params = dict(model.named_parameters())
        self.start = {name: p.detach().clone() for name, p in params.items()}
        self.server_control = {name: server[name].to(p.device) for name, p in params.items()}
        self.local_control = {
            name: local[name].to(p.device) if name in local else torch.zeros_like(p) for name, p in params.items()
        }
        self.correction = {name: self.server_control[name] - self.local_control[name] for name in params}
        self.control_update = ArrayRecord()

    def gradient_correction(self) -> dict[str, torch.Tensor]:
        """g ← g + c − c_i, before momentum and weight decay."""
        return self.correction

    def end(self, model: nn.Module, total_loss: float) -> dict[str, float]:
        """After training: c_i⁺ = c_i − c + (x − y_i)/(η·momentum_step_sum(K, β)), kept in ``context.state``."""
        metrics = super().end(model, total_loss)
        scale = 1.0 / (self.learning_rate() * momentum_step_sum(self.steps, self.config.momentum))
        with torch.no_grad():
            updated = {
                name: self.local_control[name] - self.server_control[name] + (self.start[name] - p) * scale
                for name, p in model.named_parameters()
            }
            delta = {name: updated[name] - self.local_control[name] for name in updated}

        def like_the_model(values: dict[str, torch.Tensor]) -> ArrayRecord:
            return ArrayRecord(
                {
                    key: values[key].detach().cpu() if key in values else torch.zeros_like(t).cpu()
                    for key, t in federated_state(model).items()
                }
            )

        self.context.state[STATE_KEY] = like_the_model(updated)
        self.control_update = like_the_model(delta)
        return {
            **metrics,
            "local-steps": float(self.steps),
            "control-norm-start": _norm(self.local_control),
            "control-norm-end": _norm(updated),
        }

    def reply_records(self, data: ClientData) -> dict[str, ArrayRecord]:
        return {CONTROL: self.control_update}


STRATEGIES.register(
    Algorithm(
        "scaffold",
        Scaffold,
        ScaffoldUpdate,
        "control variates correct client drift (option II; scaffold-server-lr)",
        ScaffoldSettings,
        paper="Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020",
        renamed={"server-lr": "scaffold-server-lr"},
    )
)
