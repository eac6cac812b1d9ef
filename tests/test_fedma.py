"""The ``fedma`` strategy: its stage plan, the per-class output average, the schedule and the client's freezing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fl_app.config import RunConfig
from core.model_io import federated_state
from models import build_model, permute_state, random_permutations
from strategies import get_strategy
from strategies.base import MetricAggregation
from strategies.fedma import CLASS_COUNTS, STAGE, FedMAUpdate, completion_plan, frozen_at, per_class_average

NUM_CLASSES = 10


def _model(name: str = "small-mlp", seed: int = 0):
    torch.manual_seed(seed)
    return build_model(name, (1, 8, 8), NUM_CLASSES)


def test_stages_complete_each_layer_once_its_groups_are_matched():
    spec, state = (m := _model()).permutation_spec(), federated_state(m)
    plan = completion_plan(spec, state)
    assert plan == [{f"hidden.{i}.weight", f"hidden.{i}.bias"} for i in range(4)] + [
        {"classifier.weight", "classifier.bias"}]
    assert frozen_at(spec, state, 0) == set()
    assert frozen_at(spec, state, 4) == set(state) - {"classifier.weight", "classifier.bias"}


def test_shared_groups_complete_everything_they_carry():
    model = _model("transformer-1")
    plan = completion_plan(model.permutation_spec(), federated_state(model))
    assert len(plan) == 5  # stream, attn.qk, attn.v, mlp, output layer
    assert {"embed.weight", "positions", "attn_norm.weight", "attn.out.bias", "final_norm.bias"} <= plan[0]
    assert plan[1] == {"attn.query.weight", "attn.query.bias", "attn.key.weight", "attn.key.bias"}
    assert plan[2] == {"attn.value.weight", "attn.value.bias", "attn.out.weight"}
    resnet = completion_plan((r := _model("resnet20")).permutation_spec(), federated_state(r))
    assert "blocks.2.bn2.running_mean" in resnet[0] and "blocks.0.conv2.weight" in resnet[1]


def test_output_rows_are_weighted_by_class_counts():
    a = {"classifier.weight": torch.zeros(3, 2), "classifier.bias": torch.zeros(3)}
    b = {"classifier.weight": torch.ones(3, 2), "classifier.bias": torch.ones(3)}
    counts = torch.tensor([[3, 0, 0], [1, 5, 0]])  # nobody has class 2: example weights 1:3
    averaged = per_class_average([a, b], counts, [1.0, 3.0], ["classifier.weight", "classifier.bias"])
    torch.testing.assert_close(averaged["classifier.bias"], torch.tensor([0.25, 1.0, 0.75]))
    torch.testing.assert_close(averaged["classifier.weight"][:, 0], torch.tensor([0.25, 1.0, 0.75]))


def _reply(state, node: int, counts: torch.Tensor, examples: int = 10):
    content = RecordDict({"arrays": ArrayRecord({k: v.clone() for k, v in state.items()}),
                          CLASS_COUNTS: ArrayRecord({"counts": counts}),
                          "metrics": MetricRecord({"num-examples": examples})})
    return SimpleNamespace(content=content, has_error=lambda: False, metadata=SimpleNamespace(reply_to_message_id="", src_node_id=node))


def _strategy(global_state, **config):
    fold = lambda records, key: MetricRecord({"n": len(records)})  # noqa: E731
    run = RunConfig(strategy="fedma", model="small-mlp", dataset="digits", **config)
    strategy = get_strategy("fedma").build_server(run, MetricAggregation(fold, fold))
    strategy._reference = ArrayRecord({k: v.clone() for k, v in global_state.items()})
    strategy.cycle_start = {k: v.clone() for k, v in global_state.items()}
    return strategy


@pytest.mark.parametrize(("cost", "reference"), [("weight", "global"), ("l1", "global"), ("l1", "iterative")])
def test_a_cycle_matches_a_permuted_client_back_layer_by_layer(cost, reference):
    model = _model()
    spec, state = model.permutation_spec(), federated_state(model)
    permuted = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(1)))
    counts = {1: torch.arange(NUM_CLASSES), 2: torch.arange(NUM_CLASSES).flip(0)}
    strategy = _strategy(state, match_cost=cost, match_reference=reference)

    arrays, metrics = strategy.aggregate_train(1, [_reply(state, 1, counts[1]), _reply(permuted, 2, counts[2])])
    assert metrics["n"] == 2 and strategy.stage == 1
    for stage in range(1, 5):  # clients that do not train send back the models they are sent
        assert strategy.stage == stage and sorted(strategy.client_models) == [1, 2]
        replies = [_reply(model, node, counts[node]) for node, model in strategy.client_models.items()]
        arrays, _ = strategy.aggregate_train(stage + 1, replies)
    assert strategy.stage == 0 and not strategy.client_models
    final = arrays.to_torch_state_dict()
    assert all(torch.allclose(final[k], state[k], rtol=1e-5, atol=1e-6) for k in state)


def test_a_stage_without_usable_replies_restarts_the_cycle():
    state = federated_state(_model())
    strategy = _strategy(state)
    strategy.aggregate_train(1, [_reply(state, 1, torch.ones(NUM_CLASSES, dtype=torch.long))])
    assert strategy.stage == 1
    bad_counts = _reply(state, 1, torch.ones(3, dtype=torch.long))  # wrong length: dropped
    assert strategy.aggregate_train(2, [bad_counts]) == (None, None)
    assert strategy.stage == 0 and not strategy.client_models


@pytest.mark.parametrize(("name", "stage"), [("small-mlp", 2), ("resnet20", 1), ("small-mlp", 0)])
def test_the_client_trains_only_what_is_not_matched_yet(name, stage):
    model = _model(name)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, NUM_CLASSES, (32,))
    before = {k: v.clone() for k, v in federated_state(model).items()}
    config = RunConfig(model=name, dataset="digits", local_epochs=1, retrain_epochs=2, batch_size=8)
    update = FedMAUpdate(config, context=None, received=RecordDict({"config": ConfigRecord({STAGE: stage})}))
    update.train(model, x, y, torch.Generator().manual_seed(0), torch.device("cpu"))
    after = federated_state(model)
    frozen = frozen_at(model.permutation_spec(), before, stage)
    assert all(torch.equal(after[k], before[k]) for k in frozen)
    moved = {k for k in before if not torch.equal(after[k], before[k])}
    assert moved and moved.isdisjoint(frozen)
    assert all(p.requires_grad for p in model.parameters())
    counts = update.reply_records()[CLASS_COUNTS]["counts"].numpy()
    assert counts.tolist() == torch.bincount(y, minlength=NUM_CLASSES).tolist()


@pytest.mark.slow
def test_fedma_simulation_on_digits_completes_a_cycle_and_learns(tmp_path):
    from flwr.simulation import run_simulation

    from fl_app.client_app import build_client_app
    from fl_app.server_app import build_server_app

    config = {"strategy": "fedma", "dataset": "digits", "num-server-rounds": 4, "min-available-nodes": 3,
              "results-dir": str(tmp_path)}  # mlp: 3 groups + output layer = one cycle
    run_simulation(server_app=build_server_app(config), client_app=build_client_app(config), num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    (folder,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2, 3, 4]
    assert all(row["clients-trained"] == 3 for row in rows[1:])
    assert rows[-1]["accuracy"] > 0.3  # chance is 0.1
