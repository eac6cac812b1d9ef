"""What every model tells the layers above it about itself, next to its permutation description.

Every registered network ends in an output layer called ``classifier`` that reads the
features ``representation(x)`` returns; a strategy that treats the head apart (FedPer's
personal head, FedMA's per-class output average, MOON's representations) reads that
from :func:`head_of`, never from guessed key prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

HEAD = "classifier"


@dataclass(frozen=True)
class ModelHead:
    """The output layer: its state-dict keys, and how many classes it scores."""

    keys: tuple[str, ...]
    num_classes: int

    def holds(self, key: str) -> bool:
        return key in self.keys


def head_of(model: nn.Module) -> ModelHead:
    """The head of ``model``; refuses a model without a ``classifier`` output layer."""
    head = getattr(model, HEAD, None)
    if not isinstance(head, nn.Module):
        raise ValueError(f"{type(model).__name__} has no output layer named '{HEAD}'")
    keys = tuple(f"{HEAD}.{key}" for key, value in head.state_dict().items() if torch.is_floating_point(value))
    classes = getattr(model, "class_groups", None)
    num_classes = len(classes) if classes is not None else head.out_features
    return ModelHead(keys, int(num_classes))
