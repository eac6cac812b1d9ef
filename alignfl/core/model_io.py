"""What a model sends and receives: its floating-point state, checked on the way in.

PAN encodings are non-persistent buffers and integer counters such as BatchNorm's
``num_batches_tracked`` are local bookkeeping, so neither travels.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import nn

from alignfl.core.widths import global_width, width_of, width_options
from alignfl.models import PermutationSpec, build_model
from alignfl.models.init import INITS

if TYPE_CHECKING:
    from alignfl.core.config import RunConfig
    from alignfl.core.data import ImageDataset


def build_model_for(config: RunConfig, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """The run's network for inputs of ``input_shape`` and ``num_classes`` classes, with the run's PAN
    settings, the model's own options at the global model's width (:mod:`alignfl.core.widths`) and the run's weight
    init (:data:`alignfl.models.init.INITS`)."""
    return build_model_at(config, input_shape, num_classes, global_width(config))


def build_model_at(config: RunConfig, input_shape: tuple[int, int, int], num_classes: int, width: float) -> nn.Module:
    """:func:`build_model_for` at ``width`` times the model's ``width-factor``."""
    model = build_model(config.model, input_shape, num_classes, config.pan, **width_options(config, width))
    INITS[config.init](model)
    return model


def independent_seed(seed: int, partition_id: int) -> int:
    """The torch seed of client ``partition_id``'s own initialisation (``client-init=independent``): a function of
    the run's seed and the partition only, so every engine and the offline ``merge`` tool draw the same one, and
    none draws the server's initial model (seeded by ``seed`` alone)."""
    return seed * 1_000_003 + 500_009 + partition_id


def independent_start(
    config: RunConfig, input_shape: tuple[int, int, int], num_classes: int, partition_id: int
) -> dict[str, torch.Tensor]:
    """Client ``partition_id``'s own initial federated state at its width (:func:`alignfl.core.widths.width_of`), built
    on the CPU from :func:`independent_seed` without touching the process's torch stream."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(independent_seed(config.seed, partition_id))
        model = build_model_at(config, input_shape, num_classes, width_of(config, partition_id))
    return federated_state(model)


def build_run_model(config: RunConfig, dataset: ImageDataset) -> nn.Module:
    """The run's network for this dataset (:func:`build_model_for`)."""
    return build_model_for(config, dataset.input_shape, dataset.num_classes)


def federated_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that clients exchange: every floating-point entry of the state dict."""
    return {k: v for k, v in model.state_dict().items() if torch.is_floating_point(v)}


def to_arrays(model: nn.Module) -> ArrayRecord:
    """The model's federated state as an ArrayRecord (detached CPU copies)."""
    return arrays_of(federated_state(model))


def arrays_of(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``ArrayRecord(state)``, the same bytes, each array made by :func:`npy_array`."""
    record = ArrayRecord()
    for name, tensor in state.items():
        record[name] = npy_array(tensor.detach().cpu().numpy())
    return record


def tensors_of(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``record.to_torch_state_dict()``: the arrays as (writable) tensors, read by :func:`array_values`."""
    return {name: torch.from_numpy(array_values(array).copy()) for name, array in record.items()}


_NPY_HEADER_OF: dict[tuple[str, tuple[int, ...], bool], bytes] = {}
"""``np.save``'s header by dtype, shape and order: a model's arrays have a few shapes, sent every round."""


def npy_array(values: np.ndarray) -> Array:
    """``Array(values)``, byte for byte, at a fraction of its cost: ``np.save`` writes each array's header with
    Python's formatting (most of the time of a small array); here it is made once per dtype, shape and order and
    the data appended. Object arrays go to Flower's own path (which refuses them without pickles)."""
    if values.dtype.hasobject:
        return Array(values)
    fortran = values.flags.f_contiguous and not values.flags.c_contiguous  # as np.save decides
    key = (values.dtype.str, values.shape, fortran)
    header = _NPY_HEADER_OF.get(key)
    if header is None:
        made = Array(values)
        prefix = 10 if made.data[6] == 1 else 12
        header = made.data[: prefix + int.from_bytes(made.data[8:prefix], "little")]
        if len(_NPY_HEADER_OF) < 1024:
            _NPY_HEADER_OF[key] = header
    contiguous = values.T if fortran else values
    if not contiguous.flags.c_contiguous:  # a strided view: np.save writes its values in C order
        contiguous = np.ascontiguousarray(contiguous)
    data = b"".join((header, contiguous.data))  # one copy of the values
    return Array(dtype=str(values.dtype), shape=tuple(values.shape), stype="numpy.ndarray", data=data)


_NPY_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], bool]] = {}
"""Parsed ``.npy`` headers by their bytes: a round's replies share a few (one per array shape)."""


def array_values(array: Array) -> np.ndarray:
    """An Array's values without a copy: a read-only view of its ``.npy`` bytes. What ``Array.numpy()`` gives
    (``np.load``, which parses each header with Python's parser and copies the data), at a fraction of the cost
    for the server, which reads every reply's arrays to check and to aggregate them. Object arrays are refused
    as ``np.load`` without pickles refuses them; data whose length differs from its header's is refused."""
    data = array.data
    if array.stype != "numpy.ndarray" or len(data) < 10 or data[6] not in (1, 2):
        return array.numpy()  # other formats: Flower's own reading (and its errors)
    prefix = 10 if data[6] == 1 else 12
    offset = prefix + int.from_bytes(data[8:prefix], "little")
    header = bytes(data[:offset])
    if header not in _NPY_HEADERS:
        stream = io.BytesIO(header)
        read = np.lib.format.read_array_header_1_0 if np.lib.format.read_magic(stream)[0] == 1 else None
        shape, fortran_order, dtype = (read or np.lib.format.read_array_header_2_0)(stream)
        if dtype.hasobject:
            raise ValueError("an array of Python objects cannot be read without pickles")
        if len(_NPY_HEADERS) < 1024:
            _NPY_HEADERS[header] = (dtype, shape, fortran_order)
    else:
        dtype, shape, fortran_order = _NPY_HEADERS[header]
    count = math.prod(shape)
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(
            f"array data holds {len(data) - offset} bytes, its header {shape} of {dtype} needs {count * dtype.itemsize}"
        )
    values = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return values.reshape(shape[::-1]).T if fortran_order else values.reshape(shape)


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


def resize_to(model: nn.Module, state: Mapping[str, torch.Tensor], spec: PermutationSpec) -> None:
    """Give the model's entries the shapes of ``state`` where they differ only along axes of the permutation
    description: a model whose hidden layers grew (FedMA's matching opens new global units) is rebuilt at
    the received widths, every module the grown groups touch (norms included) sized to match. Values are left
    for :func:`load_arrays`; any other difference, or a group the description keeps at its width
    (:attr:`alignfl.models.PermutationSpec.fixed`), is refused."""
    owners = {(ref.key, ref.axis): name for name, refs in spec.groups.items() for ref in refs}
    current = model.state_dict()
    resized: dict[str, nn.Module] = {}
    for key, tensor in state.items():
        if key not in current or tuple(current[key].shape) == tuple(tensor.shape):
            continue
        axes = [axis for axis, (a, b) in enumerate(zip(current[key].shape, tensor.shape)) if a != b]
        shapes = f"'{key}' has shape {tuple(tensor.shape)}, the model {tuple(current[key].shape)}"
        if current[key].dim() != tensor.dim() or any((key, axis) not in owners for axis in axes):
            raise ValueError(f"{shapes}: only the widths of permutation groups may change")
        fixed = [owners[key, axis] for axis in axes if owners[key, axis] in spec.fixed]
        if fixed:
            raise ValueError(f"{shapes}: group {fixed[0]!r} cannot change width ({spec.fixed[fixed[0]]})")
        module_name, _, name = key.rpartition(".")
        module = model.get_submodule(module_name)
        fresh = torch.zeros(tensor.shape, dtype=current[key].dtype, device=current[key].device)
        if name in module._parameters:
            module._parameters[name] = nn.Parameter(fresh)
        else:
            module._buffers[name] = fresh
        resized[module_name] = module
    for module_name, module in resized.items():
        _fit_sizes(module_name, module)


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _fit_sizes(name: str, module: nn.Module) -> None:
    """Set the sizes a resized module's forward pass reads (features, channels, a depthwise conv's groups, a
    norm's shape) from its tensors' new shapes; refuse a grouped conv other than a depthwise one, whose groups
    would no longer split its channels."""
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    elif isinstance(module, _CONVS):
        depthwise = 1 < module.groups == module.in_channels == module.out_channels
        if module.groups > 1 and not depthwise:
            raise ValueError(f"'{name}' is a grouped convolution ({module.groups} groups): its width cannot change")
        module.out_channels = module.weight.shape[0]
        module.groups = module.out_channels if depthwise else 1
        module.in_channels = module.weight.shape[1] * module.groups
    elif isinstance(module, _BATCH_NORMS):
        module.num_features = next(t for t in (module.weight, module.running_mean) if t is not None).shape[0]
    elif isinstance(module, nn.LayerNorm):
        module.normalized_shape = tuple(module.weight.shape)
    elif isinstance(module, nn.GroupNorm):
        module.num_channels = module.weight.shape[0]
        if module.num_channels % module.num_groups:
            raise ValueError(
                f"'{name}' is a GroupNorm of {module.num_groups} groups: {module.num_channels} channels do not split"
            )


def load_arrays(model: nn.Module, arrays: ArrayRecord, state: Mapping[str, torch.Tensor] | None = None) -> None:
    """Load received arrays into ``model``, refusing a record that does not fit it; a model with a permutation
    description first takes the widths of the arrays (a global model that FedMA's matching grew). ``state``: the
    arrays already deserialised (they are otherwise, once: every message and server evaluation pays it)."""
    if state is None:
        state = arrays.to_torch_state_dict()
    if hasattr(model, "permutation_spec"):
        resize_to(model, state, model.permutation_spec())
    expected = federated_state(model)
    problem = arrays_mismatch(expected, arrays)
    if problem is not None:
        raise ValueError(f"received arrays do not fit model {type(model).__name__}: {problem}")
    model.load_state_dict(state, strict=False)
