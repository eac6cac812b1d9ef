"""Device choice, mini-batching and evaluation shared by every client update and the server."""

from __future__ import annotations

import random
from collections.abc import Iterator
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


def round_generator(seed: int, server_round: int, partition_id: int) -> torch.Generator:
    """A generator that depends only on (seed, round, client), so any worker process reproduces a client's round."""
    return torch.Generator().manual_seed(seed * 1_000_003 + server_round * 10_007 + partition_id)


def iterate_batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Mini-batches of in-memory tensors, shuffled when a generator is given (no DataLoader overhead)."""
    order = torch.randperm(len(y), generator=generator) if generator is not None else torch.arange(len(y))
    for batch in order.split(batch_size):
        # index_select copies whole rows; x[batch] takes torch's general indexing path, several times slower
        yield x.index_select(0, batch.to(x.device)), y.index_select(0, batch.to(y.device))


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
