"""The ``matched`` strategy: aggregation of permuted client models, its config keys, and one simulation."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

import models.registry as model_registry
from fl_app.config import ConfigError, RunConfig, parse_run_config
from models import PanSettings, build_model, permute_state, random_permutations
from strategies import get_strategy
from strategies.base import MetricAggregation

PAN_ON = {"pan_mode": "mul", "pan_t": 1.0, "pan_a": 0.5}


def _reply(state: dict[str, torch.Tensor], examples: int, node: int):
    content = RecordDict({"arrays": ArrayRecord({k: v.clone() for k, v in state.items()}),
                          "metrics": MetricRecord({"num-examples": examples})})
    return SimpleNamespace(content=content, has_error=lambda: False, metadata=SimpleNamespace(reply_to_message_id="", src_node_id=node))


def _strategy(global_state: dict[str, torch.Tensor], **config):
    def fold(records, key):
        return MetricRecord({"n": len(records)})

    run = RunConfig(model="small-mlp", dataset="digits", **config)
    strategy = get_strategy(run.strategy).build_server(run, MetricAggregation(fold, fold))
    strategy._reference = ArrayRecord({k: v.clone() for k, v in global_state.items()})
    return strategy


def _model_state(pan: PanSettings | None = None, seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model = build_model("small-mlp", (1, 8, 8), 10, pan)
    return model.permutation_spec(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(actual: ArrayRecord, expected: dict[str, torch.Tensor]) -> bool:
    got = actual.to_torch_state_dict()
    return got.keys() == expected.keys() and all(
        torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-6) for k in expected)


@pytest.mark.parametrize("pan", [{}, PAN_ON], ids=["pan-off", "pan-on"])
@pytest.mark.parametrize(("cost", "reference"), [("weight", "global"), ("l1", "global"), ("weight", "iterative")])
def test_a_permuted_copy_of_a_client_is_averaged_back_to_the_model(cost, reference, pan):
    spec, state = _model_state(PanSettings(pan["pan_mode"], pan["pan_t"], pan["pan_a"]) if pan else None)
    permuted = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(1)))
    replies = [_reply(state, 10, node=1), _reply(permuted, 30, node=2)]

    strategy = _strategy(state, strategy="matched", match_cost=cost, match_reference=reference, **pan)
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert _close(arrays, state)
    assert metrics["n"] == 2

    plain, _ = _strategy(state, strategy="fedavg", **pan).aggregate_train(1, replies)
    assert not _close(plain, state)  # the test can fail: plain averaging mixes unrelated units


def test_clients_are_aligned_onto_the_global_model_they_started_from():
    """Two clients holding the same permuted model average to that model put back in the global order."""
    spec, state = _model_state()
    permuted = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(3)))
    replies = [_reply(permuted, 5, 1), _reply(permuted, 7, 2)]
    arrays, _ = _strategy(state, strategy="matched").aggregate_train(1, replies)
    assert _close(arrays, state)


def test_a_reply_that_does_not_fit_is_dropped_and_no_usable_reply_keeps_the_global_model():
    spec, state = _model_state()
    bad = dict(state, **{"hidden.0.bias": torch.zeros(7)})
    strategy = _strategy(state, strategy="matched")
    arrays, metrics = strategy.aggregate_train(1, [_reply(state, 5, 1), _reply(bad, 5, 2)])
    assert _close(arrays, state) and metrics["n"] == 1
    assert strategy.aggregate_train(2, [_reply(bad, 5, 2)]) == (None, None)


def test_a_model_without_a_permutation_spec_is_refused_before_training(monkeypatch):
    monkeypatch.setattr(model_registry, "_MODELS", dict(model_registry._MODELS))
    model_registry.register_model("plain-linear")(
        lambda shape, classes, pan: nn.Sequential(nn.Flatten(), nn.Linear(64, classes)))
    config = RunConfig(strategy="matched", model="plain-linear", dataset="digits")
    with pytest.raises(ValueError, match=r"model 'plain-linear' has no permutation_spec\(\)"):
        get_strategy("matched").build_server(config, MetricAggregation(lambda r, k: MetricRecord(),
                                                                       lambda r, k: MetricRecord()))


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("match-cost", "cosine", "'l1'"),
    ("match-reference", "client", "'iterative'"),
    ("match-iterations", 0, ">= 1"),
])
def test_bad_matching_keys_are_refused_with_what_is_allowed(key, value, fragment):
    with pytest.raises(ConfigError) as error:
        parse_run_config({key: value})
    assert f"'{key}'" in str(error.value) and fragment in str(error.value)


@pytest.mark.slow
def test_matched_simulation_on_digits_completes_and_learns(tmp_path: Path):
    from flwr.simulation import run_simulation

    from fl_app.client_app import build_client_app
    from fl_app.server_app import build_server_app

    config = {"strategy": "matched", "dataset": "digits", "num-server-rounds": 2, "min-available-nodes": 3,
              "results-dir": str(tmp_path)}
    run_simulation(server_app=build_server_app(config), client_app=build_client_app(config), num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    (folder,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2]
    assert rows[-1]["clients-trained"] == 3
    assert rows[-1]["accuracy"] > 0.3  # chance is 0.1 on ten classes
