"""The server side of clients of different widths: the model of every client width, and HeteroFL's sub-models.

The widths themselves (which partition trains at which multiplier) are :mod:`alignfl.core.widths`; this module builds
the models at those widths, so it sits above :mod:`alignfl.core.model_io`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import Tensor

from alignfl.core.data import dataset_info
from alignfl.core.model_io import build_model_at
from alignfl.core.rounds.replies import CONFIG_RECORD, METRICS_RECORD, MODEL_RECORD, reply_problem
from alignfl.core.widths import WIDTH_OPTION, WIDTH_RATE, client_widths, global_width, width_of, width_options
from alignfl.plugins.options import ConfigError

if TYPE_CHECKING:
    from alignfl.core.config import RunConfig
    from alignfl.core.rounds.nodes import NodeDirectory
    from alignfl.models import PermutationSpec


def _shapes(model: torch.nn.Module) -> dict[str, Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in model.state_dict().items() if v.is_floating_point()}


class ClientWidths:
    """The model of every client width, built once before the run starts, and the per-width messages.

    Parameters
    ----------
    config : RunConfig
        The run's configuration (its model, widths and data set).
    spec : PermutationSpec or None
        The model's permutation description; required (the server aligns or slices its groups).
    initial_state : dict of str to Tensor
        The global model's state at its width.
    nested : bool
        Whether every client's model must fit inside the global model, group by group (HeteroFL's sub-models are
        the first units of every layer); refused otherwise, naming the group and its layer.
    """

    def __init__(
        self, config: RunConfig, spec: PermutationSpec | None, initial_state: dict[str, Tensor], nested: bool
    ) -> None:
        if spec is None:
            raise ConfigError(
                f"run-config key 'model' = {config.model!r} is not allowed with strategy {config.strategy!r}: the "
                "model has no permutation description to fit other widths with"
            )
        self.config, self.spec = config, spec
        self.global_width = global_width(config)
        global_sizes = spec.group_sizes(initial_state)
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
