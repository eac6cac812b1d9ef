"""Device choice, mini-batching, the local optimiser and evaluation shared by every client update and the server."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.common.logger import log
from torch import nn


def select_device(name: str) -> torch.device:
    """Resolve the ``device`` setting: ``auto`` takes CUDA when present and says so when it falls back to CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        log(INFO, "device=auto: CUDA is not available, training on CPU")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        log(WARNING, "device=%s requested but CUDA is not available: falling back to CPU", name)
        return torch.device("cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Seed Python's ``random`` (Flower samples nodes with it), numpy and torch from one value."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_torch(seed: int, device: torch.device) -> None:
    """Seed torch's CPU generator and, for a CUDA ``device``, CUDA's: ``torch.manual_seed`` for the devices a
    client trains on. ``torch.manual_seed`` itself also queues seeding for every other device backend built
    in (CUDA, XPU, MTIA) until it starts, each with a formatted stack trace: about 1.6 ms a call on a CPU,
    which many small clients pay every round."""
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


def round_generator(seed: int, server_round: int, partition_id: int) -> torch.Generator:
    """A generator that depends only on (seed, round, client), so any worker process reproduces a client's round."""
    return torch.Generator().manual_seed(seed * 1_000_003 + server_round * 10_007 + partition_id)


def batch_order(count: int, batch_size: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """The example indices of one epoch's mini-batches: a permutation drawn from ``generator`` (in order when
    None), split into batches of ``batch_size`` (the last one may be smaller)."""
    order = torch.randperm(count, generator=generator) if generator is not None else torch.arange(count)
    return order.split(batch_size)


def iterate_batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Mini-batches of in-memory tensors, shuffled when a generator is given (no DataLoader overhead)."""
    for batch in batch_order(len(y), batch_size, generator):
        # index_select copies whole rows; x[batch] takes torch's general indexing path, several times slower
        yield x.index_select(0, batch.to(x.device)), y.index_select(0, batch.to(y.device))


class PlainSGD:
    """SGD with momentum and weight decay, one tensor at a time: the arithmetic of ``torch.optim.SGD`` (its
    per-tensor path, which it takes for CPU tensors: the same values bit for bit; on CUDA torch batches the
    tensors, the same formula). Why not torch's: building any ``torch.optim`` optimizer imports
    ``torch._dynamo``, 1.8 s of CPU in a fresh process, and a deployment starts one process per message."""

    def __init__(
        self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0
    ) -> None:
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One step along each parameter's gradient (parameters without one are left alone, as torch does)."""
        for index, param in enumerate(self.params):
            if param.grad is None:
                continue
            direction = param.grad
            if self.weight_decay != 0:
                direction = direction.add(param, alpha=self.weight_decay)
            if self.momentum != 0:
                buffer = self.momentum_buffers[index]
                if buffer is None:
                    buffer = self.momentum_buffers[index] = direction.detach().clone()
                else:
                    buffer.mul_(self.momentum).add_(direction, alpha=1.0)
                direction = buffer
            param.add_(direction, alpha=-self.lr)


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, batch_size: int = 1024
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y)."""
    if len(y) == 0:
        return float("nan"), float("nan")
    model.eval()
    total_loss, correct = 0.0, 0
    for xb, yb in iterate_batches(x, y, batch_size):
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        logits = model(xb)
        total_loss += nn.functional.cross_entropy(logits, yb, reduction="sum").item()
        correct += (logits.argmax(dim=1) == yb).sum().item()
    return total_loss / len(y), correct / len(y)
