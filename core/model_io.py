"""What a model sends and receives: its floating-point state, checked on the way in.

PAN encodings are non-persistent buffers and integer counters such as BatchNorm's
``num_batches_tracked`` are local bookkeeping, so neither travels.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from flwr.app import ArrayRecord
from torch import nn

from models import build_model
from models.init import INITS

if TYPE_CHECKING:
    from core.config import RunConfig
    from core.data import ImageDataset


def build_model_for(config: RunConfig, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """The run's network for inputs of ``input_shape`` and ``num_classes`` classes, with the run's PAN
    settings, the model's own options and the run's weight init (:data:`models.init.INITS`)."""
    options = {f.name: getattr(config.model_options, f.name) for f in dataclasses.fields(config.model_options)}
    model = build_model(config.model, input_shape, num_classes, config.pan, **options)
    INITS[config.init](model)
    return model


def build_run_model(config: RunConfig, dataset: ImageDataset) -> nn.Module:
    """The run's network for this dataset (:func:`build_model_for`)."""
    return build_model_for(config, dataset.input_shape, dataset.num_classes)


def federated_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that clients exchange: every floating-point entry of the state dict."""
    return {k: v for k, v in model.state_dict().items() if torch.is_floating_point(v)}


def to_arrays(model: nn.Module) -> ArrayRecord:
    """The model's federated state as an ArrayRecord (detached CPU copies)."""
    return ArrayRecord({k: v.detach().cpu() for k, v in federated_state(model).items()})


def arrays_mismatch(expected: dict[str, torch.Tensor], arrays: ArrayRecord) -> str | None:
    """Describe how ``arrays`` differ in keys or shapes from ``expected``; None when they match."""
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        return f"missing keys {missing[:5]}, unexpected keys {extra[:5]}"
    for key, tensor in expected.items():
        if tuple(arrays[key].shape) != tuple(tensor.shape):
            return f"'{key}' has shape {tuple(arrays[key].shape)}, expected {tuple(tensor.shape)}"
    return None


def load_arrays(model: nn.Module, arrays: ArrayRecord) -> None:
    """Load received arrays into ``model``, refusing a record that does not fit it."""
    expected = federated_state(model)
    problem = arrays_mismatch(expected, arrays)
    if problem is not None:
        raise ValueError(f"received arrays do not fit model {type(model).__name__}: {problem}")
    model.load_state_dict(arrays.to_torch_state_dict(), strict=False)
