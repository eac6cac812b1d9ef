"""Clients of different widths: the width of every partition's model, the global model's, and the shapes at each.

Two common run keys (:mod:`alignfl.core.config`) set them. ``client-widths`` gives each partition a width
multiplier, cycled over the partitions (``"0.5,1,1,2"``: partition ``p`` gets the ``p mod 4``-th); ``global-width``
is the global model's (0: the widest client's, or 1 without ``client-widths``). A multiplier scales the model's
``width-factor`` option, so only models that take it (:func:`models_with_widths`) accept widths; every hidden
width of a client's model is then ``round(J * width-factor * multiplier)`` as that model builds it.

Models travel at their client's width: the server sends a narrower (or wider) model, the client's model takes
the received widths when it loads it (:func:`alignfl.core.model_io.load_arrays`) and replies at that width. A strategy
whose server side sets :attr:`alignfl.core.rounds.strategy.ServerStrategy.mixed_widths` handles that: it builds a
:class:`alignfl.core.rounds.sub_models.ClientWidths` as its ``client_widths``, and the round's messages and reply checks
then go at each client's width; every other strategy refuses a run whose widths differ (:func:`refuse_mixed_widths`),
before anything starts. Widths past the last partition reach no client (:func:`unused_widths`): where they would
set the global width they are refused, else named in a warning (:func:`check_widths_used`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from alignfl.models.registry import list_models, option_names
from alignfl.plugins.options import ConfigError

if TYPE_CHECKING:
    from alignfl.core.config import RunConfig

WIDTH_OPTION = "width_factor"
WIDTH_RATE = "width-rate"
"""Training-message config entry: the client's width over the global model's (HeteroFL's scaler reads it)."""


def models_with_widths() -> list[str]:
    """The models that take a ``width-factor`` option, sorted."""
    return [name for name in list_models() if WIDTH_OPTION in option_names(name)]


def client_widths(config: RunConfig) -> tuple[float, ...]:
    """The ``client-widths`` multipliers in order (empty when unset)."""
    return tuple(float(item) for item in config.client_widths.split(",")) if config.client_widths.strip() else ()


def global_width(config: RunConfig) -> float:
    """The global model's multiplier: ``global-width``, else the widest client's, else 1."""
    return config.global_width or max(client_widths(config), default=1.0)


def width_of(config: RunConfig, partition: int | None) -> float:
    """Partition ``partition``'s multiplier (the global one without ``client-widths`` or for an unknown partition)."""
    widths = client_widths(config)
    return widths[partition % len(widths)] if widths and partition is not None else global_width(config)


def mixed_widths(config: RunConfig) -> bool:
    """Whether some client's width differs from the global model's."""
    return any(width != global_width(config) for width in client_widths(config))


def unused_widths(config: RunConfig, num_partitions: int) -> tuple[float, ...]:
    """The ``client-widths`` no partition of ``num_partitions`` gets (with fewer partitions than widths), sorted."""
    widths = client_widths(config)
    return tuple(sorted(set(widths[num_partitions:]) - set(widths[:num_partitions])))


def check_widths_used(config: RunConfig, num_partitions: int) -> str | None:
    """Refuse widths no client gets that would still set the global width (the widest, when ``global-width`` is
    unset): the run would train clients for a global model none of them has. Unused widths that change nothing
    come back as a warning to log; None when every width is used."""
    unused = unused_widths(config, num_partitions)
    if not unused:
        return None
    given = f"run-config key 'client-widths' = {config.client_widths!r} with {num_partitions} client(s)"
    missed = f"no client gets width {', '.join(f'{width:g}' for width in unused)}"
    used_global = config.global_width or max(client_widths(config)[:num_partitions])
    if used_global != global_width(config):
        raise ConfigError(
            f"{given} is not allowed: {missed}, yet it sets the global model's width ({global_width(config):g}, "
            f"where the widest client's is {used_global:g}). Give at most {num_partitions} widths (partition p gets "
            "the (p mod count)-th), or set 'global-width'"
        )
    return f"{given}: {missed}; those widths are not used"


def width_options(config: RunConfig, width: float) -> dict[str, Any]:
    """The model's keyword options for a model ``width`` times the run's; refuses a model without ``width-factor``
    when a width other than 1 is asked for (naming the key that asks)."""
    options = {f.name: getattr(config.model_options, f.name) for f in dataclasses.fields(config.model_options)}
    if WIDTH_OPTION in options:
        options[WIDTH_OPTION] = options[WIDTH_OPTION] * width
    elif width != 1.0 or config.client_widths.strip():
        key, value = (
            ("client-widths", config.client_widths) if config.client_widths.strip() else ("global-width", width)
        )
        raise ConfigError(
            f"run-config key '{key}' = {value!r} is not allowed with model {config.model!r}, which takes no "
            f"width-factor: models of other widths are {models_with_widths()}"
        )
    return options


def refuse_mixed_widths(config: RunConfig) -> None:
    """Refuse a run whose clients' widths differ from the global model's, for a strategy that averages models of
    one width."""
    if mixed_widths(config):
        raise ConfigError(
            f"run-config key 'client-widths' = {config.client_widths!r} (global width {global_width(config)}) is not "
            f"allowed with strategy {config.strategy!r}, which needs every client at the global width: choose a "
            "strategy for clients of different widths (otfusion, heterofl) or equal widths"
        )
