"""Many clients' local SGD as one computation: their models stacked along a new first axis, one step of all
of them at once with ``torch.func`` (``functional_call`` under ``vmap`` of ``grad``).

The arithmetic is the sequential update's (:class:`core.training.sgd.PlainSGD` after cross-entropy, plus an
algorithm's parameter-only loss term and constant gradient correction): each client's batches in its own
order, weight decay, momentum (each client's buffer starts with its first step's direction) and its
BatchNorm statistics (buffers stacked too, updated in place under ``vmap``). Clients of unequal sizes take
unequal numbers of steps, and their last batch may be smaller: a step trains the clients that still have a
batch, grouped by batch size (one ``vmap`` per size), so every client sees exactly its own batches and
BatchNorm's batch statistics are never diluted by padding. Results equal the sequential update's up to
floating-point rounding (``vmap`` batches the matrix products).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

Penalty = Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor]
"""A loss term of the parameters alone: (parameters, the parameters the client started from) → scalar."""


@dataclass(frozen=True)
class ClientSteps:
    """One client's share of a stacked update.

    ``batches`` are index tensors into (``x``, ``y``), one per step in the order the sequential update
    takes them; ``correction`` (parameter name → tensor, or None) is added to every step's gradient."""

    x: torch.Tensor
    y: torch.Tensor
    batches: Sequence[torch.Tensor]
    correction: Mapping[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class StackedResult:
    """Per client: its final state (the model's state-dict keys that train or are persistent buffers), the
    loss of each of its steps and its number of steps."""

    states: list[dict[str, torch.Tensor]]
    losses: list[list[float]]

    def steps(self, client: int) -> int:
        return len(self.losses[client])


def stacked_state_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """The parameters and the persistent buffers a stacked update carries per client (non-persistent buffers
    such as PAN encodings are the same for every client and stay the module's)."""
    persistent = set(model.state_dict())
    return [name for name, _ in model.named_parameters()], [n for n, _ in model.named_buffers() if n in persistent]


def unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot train stacked, or None: random layers (dropout) would draw other numbers than the
    sequential update, and frozen parameters take no step there."""
    random_layers = [name for name, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    if any(model.get_submodule(name).p > 0 for name in random_layers):
        return f"its dropout layers ({', '.join(random_layers[:3])}) draw random numbers per client"
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        return f"parameters {frozen[:3]} are frozen"
    return None


class StackedTrainer:
    """Trains ``len(starts)`` copies of ``model`` at once; ``model`` lends its modules and is left unchanged.

    Parameters
    ----------
    model : nn.Module
        The architecture every client shares (its non-persistent buffers are used as they are).
    starts : list of dict
        Each client's starting state (from :func:`stacked_state_names`' entries of its ``state_dict``).
    lr, momentum, weight_decay : float
        :class:`core.training.sgd.PlainSGD`'s settings, the same for every client.
    penalty : Penalty or None
        A loss term added to cross-entropy, of each client's parameters and its starting parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        starts: Sequence[Mapping[str, torch.Tensor]],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        penalty: Penalty | None = None,
    ) -> None:
        self.model = model
        self.param_names, self.buffer_names = stacked_state_names(model)
        self.params = {n: torch.stack([s[n].detach() for s in starts]) for n in self.param_names}
        self.buffers = {n: torch.stack([s[n].detach() for s in starts]) for n in self.buffer_names}
        self.anchor = {n: t.clone() for n, t in self.params.items()} if penalty is not None else {}
        self.lr, self.momentum, self.weight_decay, self.penalty = lr, momentum, weight_decay, penalty
        self.momentum_buffers: dict[str, torch.Tensor] = {}
        self.step_of_client = vmap(grad_and_value(self._loss), randomness="error")

    def _loss(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        anchor: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> torch.Tensor:
        loss = nn.functional.cross_entropy(functional_call(self.model, (params, buffers), (x,)), y)
        if self.penalty is None:
            return loss
        names = self.param_names
        return loss + self.penalty([params[n] for n in names], [anchor[n] for n in names])

    def run(self, clients: Sequence[ClientSteps]) -> StackedResult:
        """Every client's steps. The clients are ordered by decreasing number of steps, then decreasing size of
        the last batch, so that the clients with a batch left at any step, grouped by its size, are contiguous
        rows of the stacked state: every group steps on views, without copies."""
        count = len(clients)
        if count != len(next(iter(self.params.values()))):
            raise ValueError(f"{count} clients for {len(next(iter(self.params.values())))} starting states")
        order = sorted(range(count), key=lambda i: (-len(clients[i].batches), -len(clients[i].batches[-1])))
        ordered = [clients[i] for i in order]
        device = next(iter(self.params.values())).device
        permutation = torch.tensor(order, device=device)
        for stack in (self.params, self.buffers, self.anchor):
            for name, tensor in stack.items():
                stack[name] = tensor.index_select(0, permutation)
        offsets = torch.tensor([0] + [len(c.y) for c in ordered]).cumsum(0).tolist()
        all_x = torch.cat([c.x.to(device) for c in ordered])
        all_y = torch.cat([c.y.to(device) for c in ordered])
        corrections = self._stacked_corrections(ordered)
        losses: list[list[torch.Tensor]] = [[] for _ in ordered]
        was_training = self.model.training
        self.model.train()
        try:
            for step in range(len(ordered[0].batches)):
                for first, stop in _runs([len(c.batches[step]) for c in ordered if step < len(c.batches)]):
                    members = range(first, stop)
                    rows = torch.cat([ordered[i].batches[step].to(device) + offsets[i] for i in members])
                    xb = all_x.index_select(0, rows).unflatten(0, (len(members), -1))
                    yb = all_y.index_select(0, rows).unflatten(0, (len(members), -1))
                    group_losses = self._step(step, slice(first, stop), xb, yb, corrections)
                    for i, loss in zip(members, group_losses.unbind(), strict=True):
                        losses[i].append(loss)
        finally:
            self.model.train(was_training)
        names = self.param_names + self.buffer_names
        stacked = {**self.params, **self.buffers}
        position = {client: row for row, client in enumerate(order)}
        return StackedResult(
            [{n: stacked[n][position[i]] for n in names} for i in range(count)],
            [torch.stack(losses[position[i]]).tolist() for i in range(count)],
        )

    def _stacked_corrections(self, clients: Sequence[ClientSteps]) -> dict[str, torch.Tensor] | None:
        given = [c.correction is not None for c in clients]
        if not any(given):
            return None
        if not all(given):
            raise ValueError("either every client of a stacked update has a gradient correction or none has")
        return {n: torch.stack([c.correction[n] for c in clients]) for n in self.param_names}  # type: ignore[index]

    def _step(
        self, step: int, rows: slice, xb: torch.Tensor, yb: torch.Tensor, corrections: dict[str, torch.Tensor] | None
    ) -> torch.Tensor:
        """One SGD step of the clients in ``rows`` of the stacked state (views, updated in place; BatchNorm's
        statistics are updated in place under ``vmap``); returns their losses."""
        params = {n: t[rows] for n, t in self.params.items()}
        buffers = {n: t[rows] for n, t in self.buffers.items()}
        grads, loss = self.step_of_client(params, buffers, {n: t[rows] for n, t in self.anchor.items()}, xb, yb)
        with torch.no_grad():
            for name in self.param_names:
                direction = grads[name]
                if corrections is not None:
                    direction = direction.add_(corrections[name][rows])
                if self.weight_decay != 0:
                    direction = direction.add_(params[name], alpha=self.weight_decay)  # grads are ours: in place
                if self.momentum != 0:
                    direction = self._momentum(name, step, rows, direction)
                params[name].add_(direction, alpha=-self.lr)
        return loss.detach()

    def _momentum(self, name: str, step: int, rows: slice, direction: torch.Tensor) -> torch.Tensor:
        """``PlainSGD``'s buffer: the first step's direction, then β·buffer + direction."""
        if name not in self.momentum_buffers:
            self.momentum_buffers[name] = torch.zeros_like(self.params[name])
        buffer = self.momentum_buffers[name][rows]
        if step == 0:  # every client's first step is step 0
            buffer.copy_(direction)
        else:
            buffer.mul_(self.momentum).add_(direction, alpha=1.0)
        return buffer


def _runs(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of the runs of equal values in ``sizes``."""
    runs, first = [], 0
    for index in range(1, len(sizes) + 1):
        if index == len(sizes) or sizes[index] != sizes[first]:
            runs.append((first, index))
            first = index
    return runs
