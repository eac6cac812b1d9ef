"""Many clients' local SGD as one computation: their models stacked along a new first axis, one step of all
of them at once with ``torch.func`` (``functional_call`` under ``vmap`` of ``grad``).

The arithmetic is the sequential update's (:class:`alignfl.core.training.sgd.PlainSGD` after cross-entropy, plus an
algorithm's parameter-only loss term and constant gradient correction): each client's batches in its own
order, weight decay, momentum (each client's buffer starts with its first step's direction) and its
BatchNorm statistics (buffers stacked too, updated in place under ``vmap``). Clients of unequal sizes take
unequal numbers of steps, and their last batch may be smaller: a step trains the clients that still have a
batch, grouped by batch size (one ``vmap`` per size), so every client sees exactly its own batches and
BatchNorm's batch statistics are never diluted by padding. Results equal the sequential update's up to
floating-point rounding (``vmap`` batches the matrix products).

Models with a forward pass over stacked clients (:func:`alignfl.core.training.stacked_forward.stacked_forward`: the
MLPs) take a faster path, on a CPU in stacks of at most :data:`STACKED_FORWARD_BYTES` (:func:`clients_per_stack`): no ``vmap``,
one batched product per layer and the plain autograd engine; each step trains every client that still has a batch (a
shorter last batch is padded with examples of weight 0, exact since no layer mixes examples), so the clients that have
run out cost nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from alignfl.core.training.stacked_forward import StackedForward, stacked_forward


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


STACKED_FORWARD_BYTES = 32 * 2**20
"""On a CPU, the largest stack of parameters (all clients') trained through a stacked forward pass; more clients
train as several stacks (:func:`clients_per_stack`). Above it each step's fresh gradients are blocks beyond glibc's
largest ``mmap`` threshold (32 MiB), which ``malloc`` maps, and the kernel faults in and zeroes, anew every step:
the weight gradient of 8 clients of a 1024 x 1024 layer (32 MiB) took 7 x as long in a fresh tensor as into a kept
one (benchmarks/RESULTS.md, engines and speed)."""


MIN_CLIENTS_PER_STACK = 8
"""Fewer clients than this a stack (models of over 4 MiB of parameters) do not train stacked on a CPU
(:func:`pays_on_cpu`): a step of such wide layers is bound by reading and writing the weights, which stacking
does not save, and stacking adds a copy of every client's model. ``benchmarks/stacked_step.py``: 7 to 50 clients
of the 1024-wide MLP (5 steps of batch 10) took 1.2-1.35 x as long stacked as one after another
(benchmarks/RESULTS.md)."""


def has_stacked_forward(model: nn.Module) -> bool:
    """Whether ``model`` trains stacked through its forward pass over stacked clients, not under ``vmap``: it has
    one, and no persistent buffers (BatchNorm's statistics are per batch)."""
    _, buffers = stacked_state_names(model)
    return stacked_forward(model) is not None and not buffers


def clients_per_stack(model: nn.Module, cuda: bool) -> int | None:
    """How many copies of ``model`` at most train as one stacked update: on a CPU, through its stacked forward pass,
    as many as :data:`STACKED_FORWARD_BYTES` holds (at least one); None for any number (on CUDA, or under ``vmap``).
    A round's clients beyond it train as several stacked updates (the engines' workers split them)."""
    if cuda or not has_stacked_forward(model):
        return None
    return max(1, _copies_in_a_stack(model))


def parameter_bytes(model: nn.Module) -> int:
    """The bytes of one copy of ``model``'s parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _copies_in_a_stack(model: nn.Module) -> int:
    """How many copies of ``model``'s parameters :data:`STACKED_FORWARD_BYTES` holds."""
    return STACKED_FORWARD_BYTES // parameter_bytes(model)


def pays_on_cpu(model: nn.Module) -> bool:
    """Whether stacking ``model``'s clients can pay on a CPU: at least :data:`MIN_CLIENTS_PER_STACK` copies fit
    :data:`STACKED_FORWARD_BYTES`."""
    return _copies_in_a_stack(model) >= MIN_CLIENTS_PER_STACK


def stacked_method(model: nn.Module, cuda: bool) -> str:
    """How a stacked update trains ``model``: by its forward pass over stacked clients (on a CPU in stacks of at
    most :data:`STACKED_FORWARD_BYTES`), or under ``vmap``."""
    if not has_stacked_forward(model):
        return "torch.func"
    most = clients_per_stack(model, cuda)
    if most is None:
        return "batched products"
    return f"batched products, at most {most} clients a stack ({STACKED_FORWARD_BYTES // 2**20} MiB of parameters)"


class StackedTrainer:
    """Trains ``len(starts)`` copies of ``model`` at once; ``model`` lends its modules and is left unchanged.

    Parameters
    ----------
    model : nn.Module
        The architecture every client shares (its non-persistent buffers are used as they are).
    starts : list of dict
        Each client's starting state (from :func:`stacked_state_names`' entries of its ``state_dict``).
    lr, momentum, weight_decay : float
        :class:`alignfl.core.training.sgd.PlainSGD`'s settings, the same for every client.
    proximal : float
        μ of a proximal term μ/2·‖w − w_start‖² added to each client's cross-entropy (FedProx's), 0 for none. Its
        gradient μ(w − w_start) is added analytically, as weight decay is, and its value under ``no_grad``: the
        same loss and update as autograd through the term, without tracing it every step.
    frozen : collection of str
        Parameters no client trains (they keep their starting values; FedMA's matched layers).
    """

    def __init__(
        self,
        model: nn.Module,
        starts: Sequence[Mapping[str, torch.Tensor]],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        proximal: float = 0.0,
        frozen: Collection[str] = (),
    ) -> None:
        self.model = model
        self.frozen = frozenset(frozen)
        self.param_names, self.buffer_names = stacked_state_names(model)
        self.starts = list(starts)
        self.params: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.anchor: dict[str, torch.Tensor] = {}
        self.lr, self.momentum, self.weight_decay, self.proximal = lr, momentum, weight_decay, proximal
        self.momentum_buffers: dict[str, torch.Tensor] = {}
        self.momentum_rows: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.step_of_client = vmap(grad_and_value(self._loss), randomness="error")
        self.forward = stacked_forward(model) if has_stacked_forward(model) else None

    def _loss(
        self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(self.model, (params, buffers), (x,)), y)

    @torch.no_grad()
    def _proximal_terms(self, params: Sequence[torch.Tensor], rows: slice) -> torch.Tensor:
        """μ/2·‖w − w_start‖² of each client in ``rows`` (``params``: their rows, in :attr:`param_names`' order)."""
        squares = [
            (param - self.anchor[name][rows]).flatten(1).pow(2).sum(1)
            for name, param in zip(self.param_names, params, strict=True)
        ]
        return torch.stack(squares).sum(0).mul_(0.5 * self.proximal)

    def _pull(self, direction: torch.Tensor, param: torch.Tensor, name: str, rows: slice) -> torch.Tensor:
        """``direction`` plus the proximal term's gradient μ(w − w_start), in place."""
        return direction.add_(param, alpha=self.proximal).sub_(self.anchor[name][rows], alpha=self.proximal)

    def run(self, clients: Sequence[ClientSteps]) -> StackedResult:
        """Every client's steps. The clients are ordered by decreasing number of steps, then decreasing size of
        the last batch, and their states stacked in that order, so that the clients with a batch left at any step,
        grouped by its size, are contiguous rows of the stacked state: every group steps on views, without
        copies."""
        count = len(clients)
        if count != len(self.starts):
            raise ValueError(f"{count} clients for {len(self.starts)} starting states")
        order = sorted(range(count), key=lambda i: (-len(clients[i].batches), -len(clients[i].batches[-1])))
        ordered = [clients[i] for i in order]
        self.params = {n: torch.stack([self.starts[i][n].detach() for i in order]) for n in self.param_names}
        self.buffers = {n: torch.stack([self.starts[i][n].detach() for i in order]) for n in self.buffer_names}
        self.anchor = {n: t.clone() for n, t in self.params.items()} if self.proximal != 0 else {}
        device = next(iter(self.params.values())).device
        offsets = torch.tensor([0] + [len(c.y) for c in ordered]).cumsum(0).tolist()
        all_x = torch.cat([c.x.to(device) for c in ordered])
        all_y = torch.cat([c.y.to(device) for c in ordered])
        corrections = self._stacked_corrections(ordered)
        was_training = self.model.training
        self.model.train()
        try:
            if self.forward is not None:
                losses = self._run_padded(ordered, all_x, all_y, offsets, corrections)
            else:
                self.momentum_buffers = (
                    {n: torch.zeros_like(t) for n, t in self.params.items()} if self.momentum else {}
                )
                self.momentum_rows = {}
                losses = self._run_grouped(ordered, all_x, all_y, offsets, corrections)
        finally:
            self.model.train(was_training)
        names = self.param_names + self.buffer_names
        stacked = {**self.params, **self.buffers}
        position = {client: row for row, client in enumerate(order)}
        return StackedResult(
            [{n: stacked[n][position[i]] for n in names} for i in range(count)],
            [losses[position[i]] for i in range(count)],
        )

    def _run_grouped(
        self,
        ordered: Sequence[ClientSteps],
        all_x: torch.Tensor,
        all_y: torch.Tensor,
        offsets: list[int],
        corrections: dict[str, torch.Tensor] | None,
    ) -> list[list[float]]:
        """Every step under ``vmap``, the clients with a batch left grouped by its size; each client's losses."""
        device = all_x.device
        losses: list[list[torch.Tensor]] = [[] for _ in ordered]
        for step in range(len(ordered[0].batches)):
            for first, stop in _runs([len(c.batches[step]) for c in ordered if step < len(c.batches)]):
                members = range(first, stop)
                rows = torch.cat([ordered[i].batches[step].to(device) + offsets[i] for i in members])
                xb = all_x.index_select(0, rows).unflatten(0, (len(members), -1))
                yb = all_y.index_select(0, rows).unflatten(0, (len(members), -1))
                group_losses = self._step(step, slice(first, stop), xb, yb, corrections)
                for i, loss in zip(members, group_losses.unbind(), strict=True):
                    losses[i].append(loss)
        return [torch.stack(client).tolist() for client in losses]

    def _run_padded(
        self,
        ordered: Sequence[ClientSteps],
        all_x: torch.Tensor,
        all_y: torch.Tensor,
        offsets: list[int],
        corrections: dict[str, torch.Tensor] | None,
    ) -> list[list[float]]:
        """Every step through :attr:`forward`, on the clients with a batch left (the first rows: ``ordered`` by
        decreasing number of steps); each client's losses."""
        forward = self.forward
        if forward is None:
            raise ValueError(f"{type(self.model).__name__} has no forward pass over stacked clients")
        dtype = next(iter(self.params.values())).dtype
        table, weights = _padded_batches(ordered, offsets, all_x.device, dtype)
        steps = torch.tensor([len(c.batches) for c in ordered])
        active = (steps.unsqueeze(0) > torch.arange(len(table)).unsqueeze(1)).sum(1)
        leaves: dict[int, list[torch.Tensor]] = {}  # the first rows of the stacked parameters, per row count
        losses, momentum = [], None
        for count in active.tolist():
            if count not in leaves:
                leaves[count] = [
                    self.params[n][:count].detach().requires_grad_(n not in self.frozen) for n in self.param_names
                ]
            rows = table[len(losses), :count].view(-1)
            xb = all_x.index_select(0, rows).unflatten(0, (count, -1))
            yb = all_y.index_select(0, rows).view(count, -1)
            grads, loss = self._padded_gradients(forward, leaves[count], xb, yb, weights[len(losses), :count])
            momentum = self._padded_update(leaves[count], grads, momentum, corrections)
            losses.append(loss)
        first = active.cumsum(0) - active  # where each step's losses begin in the concatenated losses
        flat = torch.cat(losses)
        return [flat[first[:count] + client].tolist() for client, count in enumerate(steps.tolist())]

    def _padded_gradients(
        self,
        forward: StackedForward,
        leaves: list[torch.Tensor],
        xb: torch.Tensor,
        yb: torch.Tensor,
        weights: torch.Tensor,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The gradients and losses of the clients of ``leaves`` (the first rows of the stacked parameters), each
        example's loss weighted by ``weights`` (1 / its batch's size, 0 for padding)."""
        with torch.enable_grad():
            logits = forward(dict(zip(self.param_names, leaves, strict=True)), xb)
            each = nn.functional.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="none")
            loss = (each.view_as(weights) * weights).sum(1)
            trained = [leaf for leaf in leaves if leaf.requires_grad]
            grads = iter(torch.autograd.grad(loss.sum(), trained))
        loss = loss.detach()
        if self.proximal != 0:
            loss = loss + self._proximal_terms(leaves, slice(0, len(xb)))
        return [next(grads) if leaf.requires_grad else torch.zeros(0) for leaf in leaves], loss

    @torch.no_grad()
    def _padded_update(
        self,
        leaves: list[torch.Tensor],
        grads: list[torch.Tensor],
        momentum: list[torch.Tensor] | None,
        corrections: dict[str, torch.Tensor] | None,
    ) -> list[torch.Tensor] | None:
        """``PlainSGD``'s step of the clients of ``leaves`` (updated in place) along ``grads`` (fresh, used up);
        returns the momentum buffers. ``momentum``: the last step's, of as many or more clients (the clients
        still training are always the first rows), None at the first step. The new buffer is the gradient
        tensor itself (β·buffer + direction, accumulated into it), so a parameter costs two operations."""
        rows = slice(0, len(leaves[0]))
        for index, (leaf, direction) in enumerate(zip(leaves, grads, strict=True)):
            if self.param_names[index] in self.frozen:
                continue
            if corrections is not None:
                direction.add_(corrections[self.param_names[index]][rows])
            if self.weight_decay != 0:
                direction.add_(leaf, alpha=self.weight_decay)
            if self.proximal != 0:
                self._pull(direction, leaf, self.param_names[index], rows)
            if momentum is not None and self.momentum != 0:
                direction.add_(momentum[index][rows], alpha=self.momentum)
            leaf.add_(direction, alpha=-self.lr)
        return grads if self.momentum != 0 else None

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
        grads, loss = self.step_of_client(params, buffers, xb, yb)
        names = self.param_names
        if self.proximal != 0:
            loss = loss + self._proximal_terms([params[n] for n in names], rows)
        self._update(step, rows, [params[n] for n in names], [grads[n] for n in names], corrections)
        return loss.detach()

    @torch.no_grad()
    def _update(
        self,
        step: int,
        rows: slice,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        corrections: dict[str, torch.Tensor] | None,
    ) -> None:
        """``PlainSGD``'s step of the clients in ``rows``: ``params`` are their views (in the order of
        :attr:`param_names`), ``grads`` fresh tensors (used up). One parameter at a time, all its operations
        before the next: a stacked parameter stays in the cache between them."""
        buffers = self._momentum_rows(rows) if self.momentum != 0 else None
        for index, (param, direction) in enumerate(zip(params, grads, strict=True)):
            if self.param_names[index] in self.frozen:
                continue
            if corrections is not None:
                direction = direction.add_(corrections[self.param_names[index]][rows])
            if self.weight_decay != 0:
                direction = direction.add_(param, alpha=self.weight_decay)
            if self.proximal != 0:
                direction = self._pull(direction, param, self.param_names[index], rows)
            if buffers is not None:
                if step == 0:  # PlainSGD's buffer starts as the first direction; every client's first step is 0
                    direction = buffers[index].copy_(direction)
                else:
                    direction = buffers[index].mul_(self.momentum).add_(direction)
            param.add_(direction, alpha=-self.lr)

    def _momentum_rows(self, rows: slice) -> list[torch.Tensor]:
        """The momentum buffers' rows ``rows`` (views, made once per row range)."""
        key = (rows.start, rows.stop)
        if key not in self.momentum_rows:
            self.momentum_rows[key] = [self.momentum_buffers[n][rows] for n in self.param_names]
        return self.momentum_rows[key]


def _padded_batches(
    clients: Sequence[ClientSteps], offsets: list[int], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every client's batches as one table ``[step, client, example]`` of indices into the concatenated data
    (``offsets``: where each client's examples begin), shorter batches padded with index 0; and each entry's
    weight in its step's loss: 1 / the batch's size, 0 for padding."""
    width = max(len(batch) for c in clients for batch in c.batches)
    table = torch.zeros(max(len(c.batches) for c in clients), len(clients), width, dtype=torch.long)
    weights = torch.zeros(table.shape, dtype=dtype)
    for index, client in enumerate(clients):
        sizes = torch.tensor([len(batch) for batch in client.batches])
        step = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
        column = torch.arange(len(step)) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)
        table[step, index, column] = torch.cat(list(client.batches)).cpu() + offsets[index]
        weights[step, index, column] = 1.0 / sizes.to(dtype)[step]
    return table.to(device), weights.to(device)


def _runs(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of the runs of equal values in ``sizes``."""
    runs, first = [], 0
    for index in range(1, len(sizes) + 1):
        if index == len(sizes) or sizes[index] != sizes[first]:
            runs.append((first, index))
            first = index
    return runs
