"""Name -> model builder registry, so configs pick a network by name without if/elif chains."""

from __future__ import annotations

from collections.abc import Callable
from numbers import Integral

from torch import nn

from models.pan import PanSettings

InputShape = tuple[int, int, int]
ModelBuilder = Callable[[InputShape, int, PanSettings], nn.Module]

_MODELS: dict[str, ModelBuilder] = {}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator registering ``builder(input_shape, num_classes, pan) -> nn.Module`` under ``name``."""

    def decorate(builder: ModelBuilder) -> ModelBuilder:
        if name in _MODELS:
            raise ValueError(f"model name {name!r} is already registered")
        _MODELS[name] = builder
        return builder

    return decorate


def list_models() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_MODELS)


def build_model(
    name: str, input_shape: tuple[int, int, int], num_classes: int, pan: PanSettings | None = None
) -> nn.Module:
    """Build a fresh model.

    Parameters
    ----------
    name : str
        A name from :func:`list_models`.
    input_shape : tuple of 3 ints
        ``(channels, height, width)`` of one input sample.
    num_classes : int
        Number of output logits (>= 2).
    pan : PanSettings, optional
        Position-aware neurons; ``None`` means PANs off.

    Raises
    ------
    ValueError
        For an unknown name (the message lists the allowed ones) or a bad shape/class count.
    """
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {list_models()}")
    shape = _check_input_shape(input_shape)
    if not _is_int(num_classes) or num_classes < 2:
        raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
    return _MODELS[name](shape, int(num_classes), pan if pan is not None else PanSettings())


def _check_input_shape(input_shape: tuple[int, int, int]) -> InputShape:
    """Return the shape as a tuple of plain ints, or raise naming what was given."""
    ok = isinstance(input_shape, (tuple, list)) and len(input_shape) == 3
    ok = ok and all(_is_int(v) and v >= 1 for v in input_shape)
    if not ok:
        raise ValueError(f"input_shape must be 3 positive ints (channels, height, width), got {input_shape!r}")
    channels, height, width = (int(v) for v in input_shape)
    return channels, height, width


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)
