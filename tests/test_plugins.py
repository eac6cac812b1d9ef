"""The plug-in architecture, end to end: every strategy × model pair the schema accepts aggregates a round of real
client replies; behaviour equals the recorded runs, on any x86-64 CPU."""

import json
from pathlib import Path

import pytest
import torch

from alignfl.core.data import dataset_info
from alignfl.core.model_io import build_model_for
from alignfl.core.rounds.runner import MetricAggregation, RoundRunner
from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.config import ConfigError, build_context, check_run, parse_run_config
from alignfl.fl_app.inprocess import InProcessGrid, run_in_process
from alignfl.models import list_models
from alignfl.models.registry import option_names
from alignfl.strategies import get_strategy, list_strategies

BASELINE = Path(__file__).parent / "data" / "strategy_baseline.json"
RELATIVE = 1e-5
SUM_TOLERANCE = 1e-4
"""How far a recorded run's floats may move on another CPU (relative; a model sum absolute), measured: the same code
on AVX-512, AVX2 and SSE float kernels (torch, MKL and oneDNN held to each by ``ATEN_CPU_CAPABILITY``,
``MKL_ENABLE_INSTRUCTIONS`` and ``ONEDNN_MAX_CPU_ISA`` on one machine) gave every recorded metric within 2e-6
relative and every model sum within 3e-5 of the recording (a sum of thousands of weights moves more than its
terms). A run that amplifies rounding has no place here: psinet's with 3 local epochs at lr 0.1 ended at
accuracy 0.28 on AVX-512 kernels and 0.52 on AVX2, a recording of one CPU's last bits, not of behaviour."""
TINY = {"dataset": "digits", "model": "small-mlp", "num-server-rounds": 2, "batch-size": 32, "device": "cpu"}


def _pair_values(strategy: str, model: str) -> dict:
    values = {
        "strategy": strategy,
        "model": model,
        "dataset": "digits",
        "device": "cpu",
        "batch-size": 16,
        "data-fraction": 0.1,
        "min-available-nodes": 2,
    }
    if "width_factor" in option_names(model):
        values["width-factor"] = 0.25
    return values


def _accepted(values: dict) -> bool:
    try:
        check_run(parse_run_config(values))
    except ConfigError:
        return False
    return True


PAIRS = [(s, m) for s in list_strategies() for m in list_models()]


@pytest.mark.parametrize(("strategy", "model"), PAIRS)
def test_every_accepted_pair_aggregates_a_round_of_real_replies(strategy, model):
    values = _pair_values(strategy, model)
    if not _accepted(values):
        with pytest.raises(ConfigError, match=f"{model}|{strategy}"):
            check_run(parse_run_config(values))
        return
    config = parse_run_config(values)
    shape, classes = dataset_info(config.dataset)
    torch.manual_seed(0)
    context = build_context(config, build_model_for(config, shape, classes))
    trained = []
    metrics = MetricAggregation(
        lambda records, key: None,
        lambda records, key: None,
        lambda round_, participation: trained.append(participation),
    )
    runner = RoundRunner(get_strategy(strategy).server(context), InProcessGrid(build_client_app(values), 2), metrics)
    arrays = runner.train_round(1, context.initial_arrays)
    assert trained[0].trained == 2, trained[0].dropped
    assert set(arrays.keys()) == set(context.initial_arrays.keys())
    assert any(
        not torch.equal(torch.from_numpy(arrays[k].numpy()), torch.from_numpy(context.initial_arrays[k].numpy()))
        for k in arrays
    )


def test_pairs_that_cannot_work_are_refused():
    refused = [pair for pair in PAIRS if not _accepted(_pair_values(*pair))]
    assert ("psinet", "mlp") in refused and ("psinet", "psi-vgg9") not in refused
    # FedMA's BBP-MAP may widen any group, which a Psi-Net's per-class groups cannot follow
    fedma_on_psi = {("fedma", model) for strategy, model in PAIRS if model.startswith("psi-")}
    assert fedma_on_psi <= set(refused)
    assert all(
        strategy == "psinet" or model in ("vgg11", "psi-vgg11") or (strategy, model) in fedma_on_psi
        for strategy, model in refused
    ), refused


def _rows(folder: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k != "elapsed-s"}
        for line in (folder / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.parametrize("strategy", list_strategies())
def test_behaviour_equals_the_recorded_runs(tmp_path, strategy):
    """2 rounds on digits, half the clients sampled, with every strategy: the metrics and the final model equal
    the recorded ones (tests/data/strategy_baseline.json; its ``_about`` says which code recorded them), keys,
    counts and structure exactly and floats within what another CPU's float kernels change (:func:`_float_noise`),
    so a change of any algorithm's behaviour fails here on any x86-64 machine."""
    recorded = json.loads(BASELINE.read_text())
    if strategy not in recorded:
        pytest.skip(f"{strategy} was added after the recording")
    settings = dict(recorded[strategy]["settings"])
    if strategy != "superfed":
        settings.pop("superfed-start")  # the old schema accepted every algorithm's keys; it was inert there
    if strategy == "fedma":
        settings["fedma-matching"] = "weight"  # FedMA's matching then (BBP-MAP, the default now, is new)
    run_in_process({**TINY, **settings, "results-dir": str(tmp_path), "run-name": "run"}, 4)
    model = torch.load(tmp_path / "run" / "model.pt")
    run = {"rows": _rows(tmp_path / "run"), "model-sums": {k: float(v.double().sum()) for k, v in model.items()}}
    assert _same_run(run, recorded[strategy]), (run, recorded[strategy])


def _same_run(run: dict, recording: dict) -> bool:
    """Every recorded metric of every round (new keys may be added, none may change) and the model's sums."""
    rows, expected = run["rows"], recording["rows"]
    return (
        len(rows) == len(expected)
        and [{key: row.get(key) for key in before} for row, before in zip(rows, expected)] == _float_noise(expected)
        and run["model-sums"] == _float_noise(recording["model-sums"], abs_tolerance=SUM_TOLERANCE)
    )


def _float_noise(recorded, abs_tolerance: float = 1e-9):
    """The recording with every float compared to :data:`RELATIVE` (or ``abs_tolerance``); counts, keys and
    structure stay exact."""
    if isinstance(recorded, float):
        return pytest.approx(recorded, rel=RELATIVE, abs=abs_tolerance)
    if isinstance(recorded, dict):
        return {key: _float_noise(value, abs_tolerance) for key, value in recorded.items()}
    if isinstance(recorded, list):
        return [_float_noise(value, abs_tolerance) for value in recorded]
    return recorded
