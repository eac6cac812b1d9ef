"""What every analysis tool shares: argument checks, model sources, output folders, plots.

Models come from two sources:

* a **run folder** written by a training run (``<run>/model.pt`` + ``<run>/config.json``),
  or a ``model.pt`` file with the run's ``config.json`` beside it; the network is rebuilt
  with :func:`alignfl.fl_app.config.parse_run_config` and :func:`alignfl.core.model_io.build_run_model`,
  and its dataset with :func:`alignfl.core.data.load_dataset`;
* a **fresh** model built from ``--model`` / ``--dataset`` with seeded PyTorch default init.

Every check here raises :class:`AnalysisError` naming the bad value and what is allowed,
and the tools run them all before loading data or computing anything.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from alignfl.core.config import default_results_root
from alignfl.core.data import ImageDataset, list_datasets, load_dataset
from alignfl.core.model_io import build_run_model, federated_state
from alignfl.fl_app.config import ConfigError, RunConfig, parse_run_config, path_problem
from alignfl.models import PanSettings, build_model, list_models
from alignfl.models.pan import PAN_MODES
from alignfl.plugins.options import settings_fields

MODEL_FILE = "model.pt"
CONFIG_FILE = "config.json"


class AnalysisError(ValueError):
    """A bad analysis input; the message names the value and what is allowed."""


@dataclass(frozen=True)
class Subcommand:
    """One ``python -m alignfl.fl_app.analysis <name>`` tool.

    ``add_arguments`` fills the tool's argparse sub-parser; ``run`` checks the parsed
    arguments (before any work), does the work, writes JSON + PNG into ``out`` and
    returns the paths it wrote.
    """

    name: str
    summary: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Path], list[Path]]


@dataclass(frozen=True)
class LoadedModel:
    """A network in eval mode, the dataset it belongs to, and where it came from."""

    model: nn.Module
    dataset: ImageDataset
    source: str
    pan: PanSettings


# --- checks -------------------------------------------------------------------------


def check_unit_interval(name: str, value: float) -> float:
    """A probability or fraction in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise AnalysisError(f"{name} must lie in [0, 1], got {value!r}")
    return float(value)


def check_positive_int(name: str, value: int) -> int:
    """An integer >= 1 (sample counts, repeats, batch sizes)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AnalysisError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_non_negative(name: str, value: float) -> float:
    """A finite number >= 0 (PAN amplitudes and periods)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise AnalysisError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_choice(name: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise AnalysisError(f"{name} {value!r} is not known; allowed: {sorted(allowed)}")
    return value


def check_fresh_model(model: str, dataset: str) -> None:
    """Model and dataset names for a fresh model, checked against the registries."""
    check_choice("--model", model, list_models())
    check_choice("--dataset", dataset, list_datasets())


def check_model_path(path: str | Path, require_config: bool = True) -> tuple[Path, Path]:
    """``(model.pt, config.json)`` of a run folder or of a model file with its config beside it.

    ``require_config=False`` accepts a bare model file (tools that only read weights).
    """
    given = Path(path).expanduser()
    if not given.exists():
        raise AnalysisError(
            f"model path '{given}' does not exist; give a run folder (with {MODEL_FILE} "
            f"and {CONFIG_FILE}) or a {MODEL_FILE} file with {CONFIG_FILE} beside it"
        )
    weights = given / MODEL_FILE if given.is_dir() else given
    config = weights.parent / CONFIG_FILE
    for needed in (weights, config) if require_config else (weights,):
        if not needed.is_file():
            raise AnalysisError(f"'{given}' is not a usable run: '{needed}' is missing")
    return weights.resolve(), config.resolve()


def check_out_dir(out: str | None, tool: str) -> Path:
    """The output folder: absolute when given, else a new ``<results root>/analysis/<tool>-<time>`` (the root:
    :func:`alignfl.core.config.default_results_root`); either must be a folder this user can write to, outside
    site-packages and alignfl's own code."""
    if out is None:
        stamp = f"{datetime.now(UTC):%Y%m%d-%H%M%S-%f}"
        folder = default_results_root() / "analysis" / f"{tool}-{stamp}"
    else:
        folder = Path(out)
        if not folder.is_absolute():
            raise AnalysisError(f"--out must be an absolute path, got '{out}'")
        if folder.exists() and not folder.is_dir():
            raise AnalysisError(f"--out '{out}' exists and is not a folder")
    problem = path_problem(folder, writable=True)
    if problem is not None:
        raise AnalysisError(
            f"--out '{folder}' is not allowed: it must be a folder of your own that this user can write to ({problem})"
        )
    return folder


# --- models -------------------------------------------------------------------------


def read_run_config(config_path: Path) -> RunConfig:
    """The run's validated config; a broken file names itself."""
    try:
        return parse_run_config(json.loads(config_path.read_text()))
    except (json.JSONDecodeError, ConfigError) as error:
        raise AnalysisError(f"cannot use run config '{config_path}': {error}") from error


def read_state(weights_path: Path) -> dict[str, Tensor]:
    """A saved state dict (tensors only, loaded on CPU)."""
    try:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as error:
        raise AnalysisError(f"cannot read model file '{weights_path}': {error}") from error
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise AnalysisError(f"'{weights_path}' does not hold a state dict of tensors")
    return dict(state)


def load_state_into(model: nn.Module, state: Mapping[str, Tensor], source: str) -> None:
    """Load a federated state (float entries only, as run folders store it), refusing one that does not fit."""
    expected = federated_state(model)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(model.state_dict()))
    if missing or extra:
        raise AnalysisError(
            f"'{source}' does not fit {type(model).__name__}: missing keys {missing[:5]}, unexpected keys {extra[:5]}"
        )
    for key, tensor in expected.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise AnalysisError(
                f"'{source}': '{key}' has shape {tuple(state[key].shape)}, the model expects {tuple(tensor.shape)}"
            )
    model.load_state_dict(dict(state), strict=False)


def load_run_model(path: str | Path) -> LoadedModel:
    """Rebuild a trained model from a run folder (or a model.pt with config.json beside it)."""
    weights, config_path = check_model_path(path)
    config = read_run_config(config_path)
    dataset = load_dataset(config.dataset, config.data_root or None)
    model = build_run_model(config, dataset)
    load_state_into(model, read_state(weights), str(weights))
    return LoadedModel(model.eval(), dataset, str(weights), config.pan)


def fresh_model(name: str, dataset_name: str, pan: PanSettings, seed: int, data_root: str | None = None) -> LoadedModel:
    """A newly initialised network (PyTorch default init, seeded) for ``dataset_name``."""
    check_fresh_model(name, dataset_name)
    dataset = load_dataset(dataset_name, data_root)
    torch.manual_seed(seed)
    model = build_model(name, dataset.input_shape, dataset.num_classes, pan)
    return LoadedModel(model.eval(), dataset, f"fresh {name} (seed {seed})", pan)


def run_or_fresh_model(run: str | None, option: str, args: argparse.Namespace) -> LoadedModel:
    """The model of a run folder given as ``option``, or a fresh one from ``--model``: exactly one of them."""
    if (run is None) == (args.model is None):
        raise AnalysisError(f"give exactly one of {option} (a run) or --model (a fresh network)")
    if run is not None:
        check_model_path(run)
        return load_run_model(run)
    return fresh_model(
        args.model, args.dataset, pan_settings(args.pan_mode, args.pan_t, args.pan_a), args.seed, args.data_root
    )


def pan_settings(mode: str, period: float, amplitude: float) -> PanSettings:
    """PanSettings from CLI values, with the CLI's option names in the errors."""
    check_choice("--pan-mode", mode, PAN_MODES)
    return PanSettings(mode, check_non_negative("--pan-t", period), check_non_negative("--pan-a", amplitude))


def select_samples(x: Tensor, y: Tensor, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """A seeded random subset of ``count`` samples (all of them when fewer exist)."""
    check_positive_int("number of samples", count)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:count]
    return x[order], y[order]


# --- CLI pieces ---------------------------------------------------------------------


def add_fresh_model_arguments(parser: argparse.ArgumentParser, with_pan: bool) -> None:
    """``--model``/``--dataset``/``--data-root`` (and optionally the PAN options) of a fresh model."""
    group = parser.add_argument_group("fresh model (instead of a run folder)")
    group.add_argument("--model", help=f"network name, one of {list_models()}")
    group.add_argument("--dataset", default="digits", help=f"dataset, one of {list_datasets()} (default: digits)")
    group.add_argument("--data-root", default=None, help="dataset root (absolute path), default: the dataset's own")
    if with_pan:
        group.add_argument("--pan-mode", default="off", help=f"PAN mode, one of {list(PAN_MODES)} (default: off)")
        group.add_argument("--pan-t", type=float, default=1.0, help="PAN period T (default: 1)")
        group.add_argument("--pan-a", type=float, default=0.0, help="PAN amplitude A (default: 0)")


_REFUSED_FIELD = re.compile(r"^\w+\.(?P<field>\w+) = (?P<value>.*?) is not allowed: (?P<allowed>.*)$", re.S)
"""How :func:`alignfl.plugins.options.check_fields` refuses a field of a settings object."""


def _shown(value: Any) -> str:
    """A default as the option takes it (``false``, not ``False``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: true or false")
    return text.lower() == "true"


def add_settings_arguments(parser: argparse.ArgumentParser, settings: type, prefix: str) -> None:
    """An option ``--<prefix><key>`` for every field of a settings class (``--bbp-max-width``), with the type,
    default and help declared there once; :func:`settings_from_arguments` reads them back."""
    for setting in settings_fields(settings):
        parser.add_argument(
            f"--{prefix}{setting.key}",
            dest=f"{prefix}{setting.key}".replace("-", "_"),
            type=_true_or_false if setting.kind is bool else setting.kind,
            default=setting.default,
            help=f"{setting.help} (default: {_shown(setting.default)})",
        )


def settings_from_arguments(args: argparse.Namespace, settings: type, prefix: str) -> Any:
    """The settings object of the options :func:`add_settings_arguments` added; an AnalysisError naming the option
    whose value its class refuses."""
    values = {
        setting.name: getattr(args, f"{prefix}{setting.key}".replace("-", "_")) for setting in settings_fields(settings)
    }
    try:
        return settings(**values)
    except ValueError as error:
        refused = _REFUSED_FIELD.match(str(error))  # "BBPSettings.sigma = 0.0 is not allowed: ..."
        if refused is None:
            raise AnalysisError(f"--{prefix}*: {error}") from None
        option = f"--{prefix}{refused['field'].replace('_', '-')}"
        raise AnalysisError(f"{option} {refused['value']} is not allowed: {refused['allowed']}") from None


def add_common_arguments(parser: argparse.ArgumentParser, seed: bool = True) -> None:
    """``--out`` for every tool; ``--seed`` for those that draw anything at random."""
    if seed:
        parser.add_argument(
            "--seed", type=int, default=0, help="seed for init, sample choice and shuffles (default: 0)"
        )
    parser.add_argument(
        "--out",
        default=None,
        help="output folder, absolute path (default: a new <results root>/analysis/<tool>-<timestamp>, the root being "
        "$ALIGNFL_RESULTS or ~/alignfl-results)",
    )


def write_json(path: Path, payload: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    return path


def save_outputs(out: Path, name: str, payload: Mapping[str, Any], fig: Any) -> list[Path]:
    """Every tool's two outputs: ``<name>.json`` and ``<name>.png`` (the figure is closed after)."""
    json_path = write_json(out / f"{name}.json", payload)
    png_path = out / f"{name}.png"
    fig.savefig(png_path, dpi=110)
    pyplot().close(fig)
    return [json_path, png_path]


def _jsonable(value: Any) -> Any:
    """Tensors and paths in payloads: lists and strings; NaN stays JSON's NaN."""
    if isinstance(value, Tensor):
        return value.tolist()
    return str(value)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (imported late: it is slow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
