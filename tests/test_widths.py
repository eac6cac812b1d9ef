"""Clients of different widths (alignfl/core/widths.py) and the two strategies that take them: otfusion and heterofl."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from alignfl.core.rounds.strategy import Reply
from alignfl.core.rounds.sub_models import first_units
from alignfl.core.widths import WIDTH_RATE, client_widths, global_width, unused_widths, width_of
from alignfl.fl_app.checkpoint import load_checkpoint
from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.config import ConfigError, build_context, check_run, parse_run_config, validate_run
from alignfl.fl_app.inprocess import InProcessGrid
from alignfl.fl_app.server_app import run_experiment
from alignfl.models import build_model, permute_state, random_permutations
from alignfl.strategies import get_strategy, list_strategies
from alignfl.strategies.heterofl import HeteroFLUpdate, hidden_layers, nested_mean

WIDTH_STRATEGIES = {"otfusion", "heterofl"}
MIXED = {"dataset": "digits", "model": "small-mlp", "client-widths": "0.5,1"}


def _server(strategy: str, **config):
    run = parse_run_config({**MIXED, "strategy": strategy, **config})
    torch.manual_seed(0)
    model = build_model("small-mlp", (1, 8, 8), 10, width_factor=global_width(run))
    return get_strategy(strategy).server(build_context(run, model)), model


def _reply(state: dict, examples: int, partition: int) -> Reply:
    metrics = MetricRecord({"num-examples": examples, "partition-id": partition})
    return Reply(partition, partition, RecordDict({"arrays": ArrayRecord(state), "metrics": metrics}), examples)


def test_widths_cycle_over_partitions_and_the_global_one_is_the_widest_unless_set():
    config = parse_run_config({**MIXED, "strategy": "otfusion", "client-widths": "0.25, 0.5,1"})
    assert client_widths(config) == (0.25, 0.5, 1.0) and global_width(config) == 1.0
    assert [width_of(config, p) for p in range(5)] == [0.25, 0.5, 1.0, 0.25, 0.5]
    assert width_of(config, None) == 1.0
    assert global_width(config.replace(global_width=0.5)) == 0.5
    assert global_width(parse_run_config({})) == 1.0


@pytest.mark.parametrize(("value", "fragment"), [("0.5,x", "comma-separated"), ("0,1", "numbers > 0"), ("-1", "> 0")])
def test_bad_widths_are_refused_naming_the_key(value, fragment):
    with pytest.raises(ConfigError, match=f"'client-widths' = '{value}' is not allowed: .*{fragment}"):
        parse_run_config({"client-widths": value})


@pytest.mark.parametrize("strategy", list_strategies())
def test_every_strategy_takes_equal_widths_and_only_the_width_strategies_take_mixed_ones(strategy):
    model = "psi-vgg9" if strategy == "psinet" else "small-mlp"
    base = {"dataset": "digits", "model": model, "strategy": strategy}
    check_run(parse_run_config({**base, "client-widths": "0.5,0.5"}))  # one width for all: a narrower model
    mixed = parse_run_config({**base, "client-widths": "0.5,1"})
    if strategy in WIDTH_STRATEGIES:
        check_run(mixed)
    else:
        with pytest.raises(ConfigError, match=f"'client-widths' = '0.5,1'.* strategy '{strategy}', which needs every"):
            check_run(mixed)


@pytest.mark.parametrize("strategy", sorted(WIDTH_STRATEGIES))
@pytest.mark.parametrize(("key", "value"), [("client-widths", "0.5,1"), ("global-width", 2.0)])
def test_a_model_that_takes_no_width_is_refused_naming_it(strategy, key, value):
    config = parse_run_config({"dataset": "digits", "model": "resnet20", "strategy": strategy, key: value})
    with pytest.raises(ConfigError, match=f"'{key}' = .* model 'resnet20', which takes no width-factor"):
        check_run(config)


def test_heterofl_refuses_a_client_wider_than_the_global_model_naming_the_layer_and_otfusion_takes_it():
    config = {**MIXED, "global-width": 0.5}
    with pytest.raises(ConfigError, match="at width 1.0 layer 'hidden.0.weight' .* has 20 units, more than .* 10"):
        check_run(parse_run_config({**config, "strategy": "heterofl"}))
    check_run(parse_run_config({**config, "strategy": "otfusion"}))


def test_otfusion_refuses_mixed_widths_without_past_correction():
    with pytest.raises(
        ConfigError, match="'otfusion-past-correction' = False is not allowed with clients of different"
    ):
        check_run(parse_run_config({**MIXED, "strategy": "otfusion", "otfusion-past-correction": False}))


def _plan(server, model, partitions: dict[int, int]) -> dict:
    directory = SimpleNamespace(partitions=partitions)
    arrays = ArrayRecord({k: v.detach().clone() for k, v in model.state_dict().items()})
    return server.plan_train(1, arrays, ConfigRecord({"server-round": 1}), lambda: list(partitions), directory)


@pytest.mark.parametrize("strategy", sorted(WIDTH_STRATEGIES))
def test_a_narrow_client_gets_a_model_of_its_width_and_a_reply_of_another_width_is_refused(strategy):
    server, model = _server(strategy)
    contents = _plan(server, model, {10: 0, 11: 1})  # node 10 holds partition 0 (width 0.5), node 11 partition 1
    narrow, full = contents[10]["arrays"].to_torch_state_dict(), contents[11]["arrays"].to_torch_state_dict()
    assert narrow["hidden.0.weight"].shape == (10, 64) and narrow["hidden.1.weight"].shape == (50, 10)
    assert full["hidden.0.weight"].shape == (20, 64)
    assert contents[10]["config"][WIDTH_RATE] == 0.5 and contents[11]["config"][WIDTH_RATE] == 1.0
    if strategy == "heterofl":
        assert all(torch.equal(narrow[k], first_units(full, narrow)[k]) for k in narrow)
    assert server.reply_problem(_reply(narrow, 5, 0).content, contents[11]["arrays"]) is None
    assert "has shape (20, 64), expected (10, 64)" in server.reply_problem(_reply(full, 5, 0).content, None)


def test_heterofl_averages_each_entry_over_the_clients_that_hold_it():
    server, model = _server("heterofl", **{"client-widths": "0.5,1"})
    full = {k: torch.ones_like(v) for k, v in model.state_dict().items()}
    half = first_units(
        {k: 3 * torch.ones_like(v) for k, v in model.state_dict().items()},
        _plan(server, model, {1: 0})[1]["arrays"].to_torch_state_dict(),
    )
    out = server.aggregate(1, [_reply(half, 1, 0), _reply(full, 3, 1)], ArrayRecord(full)).arrays.to_torch_state_dict()
    assert torch.all(out["hidden.0.weight"][:10] == 1.5) and torch.all(out["hidden.0.weight"][10:] == 1.0)
    assert torch.all(out["hidden.1.weight"][:50, :10] == 1.5) and torch.all(out["hidden.1.weight"][:, 10:] == 1.0)
    held = nested_mean({"w": torch.zeros(4)}, [{"w": torch.ones(2)}], [2.0])["w"]
    assert held.tolist() == [1.0, 1.0, 0.0, 0.0]  # indices nobody holds keep the global value


def test_otfusion_fuses_a_permuted_copy_back_into_the_model():
    server, model = _server("otfusion", **{"client-widths": ""})
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    spec = model.permutation_spec()
    copy = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(2)))
    merge = server.aggregate(1, [_reply(copy, 2, 0), _reply(state, 1, 1)], ArrayRecord(state))
    out = merge.arrays.to_torch_state_dict()
    assert all(torch.allclose(out[k], state[k], atol=1e-5) for k in state)
    shares = merge.metrics["transport-off-diagonal"]  # the copy's units all moved, the model's none
    assert set(shares) == set(spec.groups) and all(0.3 < share <= 0.5 for share in shares.values())


def test_the_heterofl_scaler_divides_hidden_outputs_while_training_only():
    torch.manual_seed(0)
    model = build_model("small-mlp", (1, 8, 8), 10)
    config = parse_run_config({**MIXED, "strategy": "heterofl", "local-epochs": 1})
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    trained = {}
    for rate in (0.5, 1.0):
        copy = build_model("small-mlp", (1, 8, 8), 10)
        copy.load_state_dict(model.state_dict())
        received = RecordDict({"config": ConfigRecord({WIDTH_RATE: rate})})
        HeteroFLUpdate(config, None, received).train(copy, x, y, torch.Generator().manual_seed(0), torch.device("cpu"))
        assert all(not layer._forward_hooks for layer in hidden_layers(copy))  # removed after training
        trained[rate] = copy.state_dict()["hidden.0.weight"]
    assert len(hidden_layers(model)) == 4 and not torch.allclose(trained[0.5], trained[1.0])


@pytest.mark.parametrize("strategy", sorted(WIDTH_STRATEGIES))
def test_width_strategies_learn_with_pans_and_a_resumed_run_equals_the_straight_one(strategy, tmp_path: Path):
    values = {
        **MIXED,
        "client-widths": "0.5,0.25,1",
        "strategy": strategy,
        "local-epochs": 3,
        "min-available-nodes": 3,
        "device": "cpu",
        "results-dir": str(tmp_path),
        "pan-mode": "mul",
        "pan-a": 0.1,
    }

    def run(name: str, **settings) -> Path:
        config = {**values, "run-name": name, **settings}
        run_experiment(InProcessGrid(build_client_app(config), 3), parse_run_config(config))
        return tmp_path / name

    straight = run("straight", **{"num-server-rounds": 2})
    stopped = run("stopped", **{"num-server-rounds": 1})
    assert load_checkpoint(stopped).round == 1
    run("ignored", **{"num-server-rounds": 2, "resume-from": str(stopped)})
    rows = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    straight_rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2] and rows[-1]["clients-trained"] == 3
    assert rows[-1]["accuracy"] == straight_rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.05  # it learns
    final, expected = torch.load(stopped / "model.pt"), torch.load(straight / "model.pt")
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    assert final["hidden.0.weight"].shape == (20, 64)  # the global model keeps the global width


@pytest.mark.parametrize(
    ("widths", "clients", "unused"),
    [("0.25,0.5,1", 2, (1.0,)), ("0.25,0.5,1", 3, ()), ("0.5,1,0.5", 2, ()), ("1,0.5,0.25", 1, (0.25, 0.5))],
)
def test_the_widths_no_client_gets_are_those_past_the_last_partition(widths, clients, unused):
    assert unused_widths(parse_run_config({**MIXED, "client-widths": widths}), clients) == unused


def test_widths_no_client_gets_are_refused_before_anything_starts_where_they_set_the_global_width(
    tmp_path, capsys, monkeypatch
):
    """``client-widths="0.25,0.5,1"`` on 2 clients: width 1 would be the global width, yet no client trains it."""
    from alignfl.fl_app.runtime import launch

    values = {**MIXED, "strategy": "otfusion", "client-widths": "0.25,0.5,1", "results-dir": str(tmp_path)}
    message = (
        "run-config key 'client-widths' = '0.25,0.5,1' with 2 client(s) is not allowed: no client gets width 1, "
        "yet it sets the global model's width (1, where the widest client's is 0.5). Give at most 2 widths"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_run(parse_run_config(values), num_partitions=2)
    run_config = " ".join(f'{key}="{value}"' for key, value in values.items())
    argv = ["--backend", "batched", "--num-supernodes", "2", "--run-config", run_config]
    monkeypatch.setattr(launch, "run_batched", None)  # starting the engine would fail loudly
    assert launch.main(argv) == 2  # the launcher's own check, before any engine starts
    assert message in capsys.readouterr().err and list(tmp_path.iterdir()) == []
    validate_run(parse_run_config(values), num_partitions=3)  # every width used
    validate_run(parse_run_config(values))  # no partition count known: nothing to check


@pytest.mark.parametrize(("extra", "unused"), [({"client-widths": "1,0.5,0.25"}, "0.25"), ({"global-width": 1.0}, "1")])
def test_widths_no_client_gets_that_change_nothing_are_named_in_a_warning(extra, unused, tmp_path, caplog):
    values = {**MIXED, "strategy": "otfusion", "client-widths": "0.25,0.5,1", "results-dir": str(tmp_path), **extra}
    with caplog.at_level(logging.WARNING, logger="flwr"):
        validate_run(parse_run_config(values), num_partitions=2)
    assert (
        f"'client-widths' = '{values['client-widths']}' with 2 client(s): no client gets width {unused}" in caplog.text
    )
