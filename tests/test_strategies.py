"""The strategy registry, FedProx's client objective, and the server's reply checks."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from fl_app.config import RunConfig
from strategies import get_strategy, list_strategies
from strategies.base import LocalUpdate, MetricAggregation, reply_problem
from strategies.fedprox import FedProxUpdate
from strategies.registry import StrategyEntry, register_strategy


def test_registry_lists_the_core_algorithms():
    assert {"fedavg", "fedprox", "fedavgm"} <= set(list_strategies())
    assert get_strategy("fedprox").client_update is FedProxUpdate
    assert get_strategy("fedavg").client_update is LocalUpdate


def test_unknown_strategy_lists_allowed():
    with pytest.raises(ValueError, match=r"unknown strategy 'fedx'.*'fedavg'"):
        get_strategy("fedx")


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(StrategyEntry("fedavg", get_strategy("fedavg").build_server, LocalUpdate, ""))


def test_fedprox_adds_half_mu_squared_distance_to_the_global_model():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    update = FedProxUpdate(RunConfig(proximal_mu=0.5), context=None)
    update.begin(model)
    plain = nn.functional.cross_entropy(model(x), y)
    assert torch.allclose(update.loss(model, x, y), plain)  # at the global model the term is zero
    with torch.no_grad():
        model.weight.add_(1.0)  # distance² = 12 entries × 1²
    expected = nn.functional.cross_entropy(model(x), y) + 0.5 * 0.5 * 12.0
    assert torch.allclose(update.loss(model, x, y), expected)


def _reply(arrays: dict[str, np.ndarray], examples, node: int = 1, **metrics):
    content = RecordDict({"arrays": ArrayRecord({k: torch.from_numpy(v) for k, v in arrays.items()}),
                          "metrics": MetricRecord({"num-examples": examples, **metrics})})
    return SimpleNamespace(content=content, has_error=lambda: False, metadata=SimpleNamespace(reply_to_message_id="", src_node_id=node))


GLOBAL = {"w": np.zeros((2, 3), dtype=np.float32), "b": np.zeros(2, dtype=np.float32)}


@pytest.mark.parametrize(
    ("arrays", "examples", "fragment"),
    [
        ({"w": GLOBAL["w"]}, 5, "missing ['b']"),
        ({**GLOBAL, "extra": np.ones(1, np.float32)}, 5, "unexpected ['extra']"),
        ({"w": np.zeros((3, 2), np.float32), "b": GLOBAL["b"]}, 5, "shape (3, 2), expected (2, 3)"),
        ({"w": np.full((2, 3), np.nan, np.float32), "b": GLOBAL["b"]}, 5, "NaN"),
        (GLOBAL, 0, "positive number"),
        (GLOBAL, -2, "positive number"),
    ],
)
def test_malformed_replies_are_described(arrays, examples, fragment):
    problem = reply_problem(_reply(arrays, examples).content, ArrayRecord({k: torch.from_numpy(v) for k, v in GLOBAL.items()}))
    assert problem is not None and fragment in problem


def test_well_formed_reply_has_no_problem():
    reference = ArrayRecord({k: torch.from_numpy(v) for k, v in GLOBAL.items()})
    assert reply_problem(_reply(GLOBAL, 3).content, reference) is None


def _aggregate(strategy_name: str, replies, **config):
    def fold(records, key):
        return MetricRecord({"n": len(records)})

    strategy = get_strategy(strategy_name).build_server(RunConfig(**config), MetricAggregation(fold, fold))
    strategy._reference = ArrayRecord({k: torch.from_numpy(v) for k, v in GLOBAL.items()})
    return strategy.aggregate_train(1, replies)


def test_fedavg_weights_by_examples_and_drops_malformed_replies():
    good_a = _reply({"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}, 1)
    good_b = _reply({"w": np.full((2, 3), 4, np.float32), "b": np.full(2, 4, np.float32)}, 3)
    broken = _reply({"w": np.full((2, 3), 100, np.float32)}, 10, node=7)
    arrays, metrics = _aggregate("fedavg", [good_a, broken, good_b])
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 3.25))  # (1·1 + 3·4) / 4
    assert metrics["n"] == 2


def test_no_usable_reply_keeps_the_global_model():
    broken = _reply({"w": GLOBAL["w"]}, 4)
    assert _aggregate("fedavg", [broken]) == (None, None)


def test_fedavgm_with_unit_lr_and_no_momentum_equals_fedavg():
    replies = [_reply({"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}, 2),
               _reply({"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)}, 2)]
    strategy = get_strategy("fedavgm").build_server(
        RunConfig(server_momentum=0.0, server_lr=1.0), MetricAggregation(lambda r, k: MetricRecord(), lambda r, k: MetricRecord()))
    strategy._reference = strategy.current_arrays = ArrayRecord({k: torch.from_numpy(v) for k, v in GLOBAL.items()})
    arrays, _ = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 0.5))


def test_fedavgm_momentum_accumulates_the_pseudo_gradient():
    strategy = get_strategy("fedavgm").build_server(
        RunConfig(server_momentum=0.5, server_lr=1.0), MetricAggregation(lambda r, k: MetricRecord(), lambda r, k: MetricRecord()))
    strategy._reference = strategy.current_arrays = ArrayRecord({k: torch.from_numpy(v) for k, v in GLOBAL.items()})
    step = {"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}
    first, _ = strategy.aggregate_train(1, [_reply(step, 1)])  # global 0 → 1: pseudo-gradient −1
    np.testing.assert_allclose(first["w"].numpy(), np.ones((2, 3)))
    second, _ = strategy.aggregate_train(2, [_reply({"w": np.full((2, 3), 2, np.float32), "b": np.full(2, 2, np.float32)}, 1)])
    # pseudo-gradient −1 again, momentum buffer 0.5·(−1) + (−1) = −1.5 → global 1 + 1.5
    np.testing.assert_allclose(second["w"].numpy(), np.full((2, 3), 2.5))
