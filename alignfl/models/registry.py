"""Name -> network: each model module registers its builders, so configs pick a network by name without if/elif
chains."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from torch import nn

from alignfl.models.pan import PanSettings
from alignfl.plugins.options import NoOptions, check_settings
from alignfl.plugins.registry import Registry

InputShape = tuple[int, int, int]
ModelBuilder = Callable[..., nn.Module]


@dataclass(frozen=True)
class Model:
    """One network: ``build(input_shape, num_classes, pan, **options) -> nn.Module`` and its settings class.

    ``options`` is the model's settings class (:mod:`alignfl.plugins.options`): its fields are the keyword
    arguments the builder takes beyond the three common ones, their defaults and checks, and
    (hyphenated) the run-config keys that set them.
    """

    name: str
    build: ModelBuilder
    options: type = NoOptions


MODELS: Registry[Model] = Registry("model")
"""Every network; a model module registers each builder with ``MODELS.register(Model(...))``."""


def model_options(name: str) -> type:
    """The settings class of the model ``name`` (:class:`alignfl.plugins.options.NoOptions` for most models)."""
    return MODELS.get(name).options


def option_names(name: str) -> tuple[str, ...]:
    """The builder's keyword options of the model ``name``."""
    return tuple(f.name for f in dataclasses.fields(model_options(name)))


def list_models() -> list[str]:
    """Registered model names, sorted."""
    return MODELS.names()


def build_model(
    name: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    pan: PanSettings | None = None,
    **options: Any,
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
    **options
        Model-specific settings, only those the model registered (:func:`model_options`).

    Raises
    ------
    ValueError
        For an unknown name (the message lists the allowed ones), an option the model
        does not take, or a bad shape/class count.
    """
    entry = MODELS.get(name)
    unknown = sorted(set(options) - set(option_names(name)))
    if unknown:
        raise ValueError(f"model {name!r} takes no option(s) {unknown}; allowed: {list(option_names(name))}")
    settings = entry.options(**options)
    check_settings(settings)
    shape = _check_input_shape(input_shape)
    if not _is_int(num_classes) or num_classes < 2:
        raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
    values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    return entry.build(shape, int(num_classes), pan if pan is not None else PanSettings(), **values)


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
