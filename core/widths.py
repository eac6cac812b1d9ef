"""Clients of different widths: the width of every partition's model, the global model's, and the shapes at each.

Two common run keys (:mod:`core.config`) set them. ``client-widths`` gives each partition a width
multiplier, cycled over the partitions (``"0.5,1,1,2"``: partition ``p`` gets the ``p mod 4``-th); ``global-width``
is the global model's (0: the widest client's, or 1 without ``client-widths``). A multiplier scales the model's
``width-factor`` option, so only models that take it (:func:`models_with_widths`) accept widths; every hidden
width of a client's model is then ``round(J * width-factor * multiplier)`` as that model builds it.

Models travel at their client's width: the server sends a narrower (or wider) model, the client's model takes
the received widths when it loads it (:func:`core.model_io.load_arrays`) and replies at that width. A strategy
whose server side sets :attr:`core.strategy.ServerStrategy.mixed_widths` handles that: it builds a
:class:`ClientWidths` as its ``client_widths``, and the round's messages and reply checks then go at each client's
width; every other strategy refuses a run whose widths differ (:func:`refuse_mixed_widths`),
before anything starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import Tensor

from core.replies import CONFIG_RECORD, METRICS_RECORD, MODEL_RECORD, reply_problem
from models.registry import list_models, option_names
from plugins.options import ConfigError

if TYPE_CHECKING:
    from core.config import RunConfig
    from core.nodes import NodeDirectory
    from core.strategy import RunContext

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


def _shapes(model: torch.nn.Module) -> dict[str, Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in model.state_dict().items() if v.is_floating_point()}


class ClientWidths:
    """The model of every client width, built once before the run starts, and the per-width messages.

    Parameters
    ----------
    context : RunContext
        The run; its model must have a permutation description (the server aligns or slices its groups).
    nested : bool
        Whether every client's model must fit inside the global model, group by group (HeteroFL's sub-models are
        the first units of every layer); refused otherwise, naming the group and its layer.
    """

    def __init__(self, context: RunContext, nested: bool) -> None:
        from core.data import dataset_info
        from core.model_io import build_model_at

        config, spec = context.config, context.spec
        if spec is None:
            raise ConfigError(
                f"run-config key 'model' = {config.model!r} is not allowed with strategy {config.strategy!r}: the "
                "model has no permutation description to fit other widths with"
            )
        self.config, self.spec = config, spec
        self.global_width = global_width(config)
        global_sizes = spec.group_sizes(context.initial_arrays.to_torch_state_dict())
        input_shape, num_classes = dataset_info(config.dataset)
        self.templates: dict[float, dict[str, Tensor]] = {}
        for width in sorted(set(client_widths(config)) | {self.global_width}):
            try:
                template = _shapes(build_model_at(config, input_shape, num_classes, width))
            except ValueError as error:
                raise ConfigError(
                    f"run-config key 'client-widths' = {config.client_widths!r}: model {config.model!r} cannot be "
                    f"built at width {width} (width-factor {width_options(config, width)[WIDTH_OPTION]:g}): {error}"
                ) from None
            sizes = spec.group_sizes(template)
            wider = [group for group, size in sizes.items() if nested and size > global_sizes[group]]
            if wider:
                group = wider[0]
                raise ConfigError(
                    f"run-config key 'client-widths' = {config.client_widths!r}: at width {width} layer "
                    f"'{spec.groups[group][0].key}' (group {group!r}) has {sizes[group]} units, more than the global "
                    f"model's {global_sizes[group]}; strategy {config.strategy!r} needs every client at most as wide "
                    f"as the global model (global-width {self.global_width})"
                )
            self.templates[width] = template

    def width(self, partition: int | None) -> float:
        return width_of(self.config, partition)

    def plan_train(
        self,
        arrays: ArrayRecord,
        config: ConfigRecord,
        nodes: list[int],
        directory: NodeDirectory,
        narrow: Callable[[dict[str, Tensor], dict[str, Tensor]], dict[str, Tensor]],
    ) -> dict[int, RecordDict]:
        """Every node's training message: the global model made the node's width by ``narrow(global state,
        template of that width)`` (once per width), and the width rate in its config."""
        state = arrays.to_torch_state_dict()
        models: dict[float, tuple[ArrayRecord, ConfigRecord]] = {}
        contents: dict[int, RecordDict] = {}
        for node in nodes:
            width = self.width(directory.partitions.get(node))
            if width not in models:
                sent = arrays if width == self.global_width else ArrayRecord(narrow(state, self.templates[width]))
                models[width] = sent, ConfigRecord({**config, WIDTH_RATE: width / self.global_width})
            sent, own_config = models[width]
            contents[node] = RecordDict({MODEL_RECORD: sent, CONFIG_RECORD: own_config})
        return contents

    def reply_problem(self, content: RecordDict, extra_arrays: tuple[str, ...] = ()) -> str | None:
        """What is wrong with a reply, measured against the model of its partition's width."""
        metrics = content.metric_records.get(METRICS_RECORD)
        partition = metrics.get("partition-id") if metrics is not None else None
        width = self.width(int(partition) if isinstance(partition, (int, float)) else None)
        return reply_problem(content, ArrayRecord(self.templates[width]), extra_arrays)


def first_units(state: dict[str, Tensor], template: dict[str, Tensor]) -> dict[str, Tensor]:
    """HeteroFL's sub-model: every entry of ``state`` cut to the first indices of ``template``'s shape along every
    axis (the first units of every group; a flattened channel's block of columns goes with it)."""
    return {key: state[key][tuple(slice(0, n) for n in shape.shape)].clone() for key, shape in template.items()}
