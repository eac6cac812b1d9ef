"""The strategy registry, FedProx's client objective, the server's reply checks and FedAvg(M)'s aggregation."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from alignfl.core.model_io import array_values, arrays_of, npy_array, tensors_of
from alignfl.core.rounds.replies import reply_problem
from alignfl.core.rounds.runner import MetricAggregation, Participation, RoundRunner
from alignfl.core.rounds.strategy import Merge, Reply, RunContext, ServerStrategy
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.inprocess import InProcessGrid
from alignfl.models.protocol import ModelHead
from alignfl.strategies import get_strategy, list_strategies
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.fedavgm import FedAvgM
from alignfl.strategies.fedprox import FedProxSettings, FedProxUpdate
from alignfl.strategies.registry import STRATEGIES, Algorithm


def test_registry_lists_the_core_algorithms():
    assert {"fedavg", "fedprox", "fedavgm"} <= set(list_strategies())
    assert get_strategy("fedprox").client is FedProxUpdate
    assert get_strategy("fedprox").settings is FedProxSettings
    assert get_strategy("fedavg").client is LocalUpdate
    assert get_strategy("fedavg").server is ServerStrategy and get_strategy("fedavgm").server is FedAvgM


def test_unknown_strategy_lists_allowed():
    with pytest.raises(ValueError, match=r"unknown strategy 'fedx'.*'fedavg'"):
        get_strategy("fedx")


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="already registered"):
        STRATEGIES.register(Algorithm("fedavg", ServerStrategy, LocalUpdate, ""))


def test_fedprox_adds_half_mu_squared_distance_to_the_global_model():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    update = FedProxUpdate(parse_run_config({"strategy": "fedprox", "fedprox-mu": 0.5}), context=None)
    update.begin(model)
    plain = nn.functional.cross_entropy(model(x), y)
    assert torch.allclose(update.loss(model, x, y), plain)  # at the global model the term is zero
    with torch.no_grad():
        model.weight.add_(1.0)  # distance² = 12 entries × 1²
    expected = nn.functional.cross_entropy(model(x), y) + 0.5 * 0.5 * 12.0
    assert torch.allclose(update.loss(model, x, y), expected)


GLOBAL = {"w": np.zeros((2, 3), dtype=np.float32), "b": np.zeros(2, dtype=np.float32)}


def _arrays(values: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in values.items()})


def _content(arrays: dict[str, np.ndarray], examples: float, **metrics: float) -> RecordDict:
    return RecordDict({"arrays": _arrays(arrays), "metrics": MetricRecord({"num-examples": examples, **metrics})})


def _filled(value: float) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, value) for k, v in GLOBAL.items()}


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
    problem = reply_problem(_content(arrays, examples), _arrays(GLOBAL))
    assert problem is not None and fragment in problem


def test_well_formed_reply_has_no_problem():
    assert reply_problem(_content(GLOBAL, 3), _arrays(GLOBAL)) is None


ARRAYS = [
    np.arange(6, dtype=np.float32).reshape(2, 3),
    np.asfortranarray(np.random.default_rng(0).random((3, 5))),
    np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],  # neither C- nor Fortran-contiguous
    np.array(3.0, dtype=np.float64),
    np.zeros((0, 4), np.float16),
    np.arange(5, dtype=np.int64),
    np.array([True, False]),
]


@pytest.mark.parametrize("values", ARRAYS)
def test_array_values_are_what_flowers_reading_gives(values):
    array = Array(values)
    read = array_values(array)
    assert read.dtype == array.numpy().dtype and read.shape == array.numpy().shape
    assert np.array_equal(read, array.numpy())


@pytest.mark.parametrize("values", ARRAYS)
def test_an_array_made_with_its_header_reused_is_flowers_byte_for_byte(values):
    expected = Array(values)
    for _ in range(2):  # the header made, then taken from the cache
        made = npy_array(values)
        assert (made.dtype, made.shape, made.stype, made.data) == (
            expected.dtype,
            expected.shape,
            expected.stype,
            expected.data,
        )
    changed = np.asarray(values + 1 if values.dtype != bool else ~values)  # same header, other data
    assert npy_array(changed).data == Array(changed).data


def test_a_records_tensors_are_flowers_and_writable():
    record = ArrayRecord({f"a{i}": Array(values) for i, values in enumerate(ARRAYS)})
    expected, got = record.to_torch_state_dict(), tensors_of(record)
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
        got[name].add_(1) if tensor.dtype != torch.bool else got[name].logical_not_()  # not a read-only view


def test_a_state_dict_becomes_flowers_arrayrecord_byte_for_byte():
    state = {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.float64), "steps": torch.tensor(7)}
    made, expected = arrays_of(state), ArrayRecord(state)
    assert list(made) == list(expected)
    assert all(made[k].data == expected[k].data and made[k].shape == expected[k].shape for k in state)


def test_a_reply_whose_array_bytes_do_not_match_their_header_is_described():
    good = _arrays(GLOBAL)["w"]
    content = _content(GLOBAL, 3)
    content["arrays"]["w"] = Array(good.dtype, tuple(good.shape), good.stype, good.data[:-4])
    problem = reply_problem(content, _arrays(GLOBAL))
    assert problem is not None and "array 'w' of 'arrays' cannot be read" in problem and "needs 24" in problem


# --- one training round of the round runner over scripted nodes -------------------------------------------


def _scripted_app(contents: list[RecordDict]) -> ClientApp:
    """Nodes that tell their partition and answer every training message with ``contents[partition]``."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return Message(contents[int(context.node_config["partition-id"])], reply_to=message)

    @app.query()
    def identify(message: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord(dict(context.node_config))}), reply_to=message)

    return app


class _Recording(ServerStrategy):
    """FedAvg that notes which of its hooks the round runner calls."""

    def __init__(self, context: RunContext) -> None:
        super().__init__(context)
        self.calls: list[str] = []

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge | None:
        self.calls.append("aggregate")
        return super().aggregate(server_round, replies, reference)

    def on_empty_round(self, server_round: int) -> None:
        self.calls.append("empty")


def _runner(
    contents: list[RecordDict],
    server_side: Callable[[RunContext], ServerStrategy] = ServerStrategy,
    values: dict[str, object] | None = None,
) -> tuple[RoundRunner, list]:
    """A round runner for ``server_side`` (run config ``values``) over nodes answering ``contents``, and the list
    of what it reports (``("train", records)`` and ``("participation", ...)``)."""
    config = parse_run_config({"min-available-nodes": len(contents), **(values or {})})
    server = server_side(RunContext(config, _arrays(GLOBAL), None, ModelHead((), 2)))
    seen: list = []
    metrics = MetricAggregation(
        lambda records, key: seen.append(("train", records)) or MetricRecord(),
        lambda records, key: MetricRecord(),
        lambda round_, participation: seen.append(("participation", participation)),
    )
    return RoundRunner(server, InProcessGrid(_scripted_app(contents), len(contents)), metrics), seen


def _train_round(contents: list[RecordDict]) -> tuple[ArrayRecord, ArrayRecord, _Recording, list]:
    """One training round of FedAvg over nodes answering ``contents``; returns the global model before and after
    it, the server side and what the runner reported."""
    runner, seen = _runner(contents, _Recording)
    reference = runner.strategy.context.initial_arrays
    return reference, runner.train_round(1, reference), runner.strategy, seen


def _participation(seen: list) -> Participation:
    (participation,) = [value for kind, value in seen if kind == "participation"]
    return participation


def test_fedavg_weights_by_examples_and_drops_malformed_replies():
    good_a, good_b = _content(_filled(1.0), 1), _content(_filled(4.0), 3)
    broken = _content({"w": np.full((2, 3), 100, np.float32)}, 10)
    _, arrays, server, seen = _train_round([good_a, broken, good_b])
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 3.25))  # (1·1 + 3·4) / 4
    participation = _participation(seen)
    assert (participation.sampled, participation.trained) == (3, 2)
    assert list(participation.dropped) == ["1"] and "missing ['b']" in participation.dropped["1"]
    (train_records,) = [records for kind, records in seen if kind == "train"]
    assert len(train_records) == 2  # the metrics are folded over the usable replies only
    assert server.calls == ["aggregate"]


def test_no_usable_reply_keeps_the_global_model():
    reference, arrays, server, seen = _train_round([_content({"w": GLOBAL["w"]}, 4)])
    assert arrays is reference
    assert server.calls == ["empty"]  # the server side hears of the empty round instead of aggregating
    assert _participation(seen).trained == 0 and not [kind for kind, _ in seen if kind == "train"]


class _Widening(ServerStrategy):
    """Returns the clients' mean with one more unit in ``b``, as BBP-MAP's new global units do."""

    def aggregate(self, server_round: int, replies: list[Reply], reference: ArrayRecord) -> Merge | None:
        mean = super().aggregate(server_round, replies, reference).arrays
        return Merge(_arrays({"w": mean["w"].numpy(), "b": np.append(mean["b"].numpy(), 0.0)}))


class _DeclaredWidening(_Widening):
    changes_shapes = True


@pytest.mark.parametrize(("server_side", "accepted"), [(_Widening, False), (_DeclaredWidening, True)])
def test_an_aggregate_of_other_shapes_is_kept_only_when_the_strategy_declares_it(server_side, accepted):
    runner, _ = _runner([_content(_filled(1.0), 1)], server_side)
    reference = runner.strategy.context.initial_arrays
    arrays = runner.train_round(1, reference)
    assert (arrays is not reference) == accepted
    assert arrays["b"].shape == ((GLOBAL["b"].size + 1,) if accepted else GLOBAL["b"].shape)


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ({}, "Starting fedavg (no settings of its own), rounds 1 to 1"),
        ({"strategy": "fedprox", "fedprox-mu": 0.5}, "Starting fedprox (fedprox-mu=0.5), rounds 1 to 1"),
    ],
)
def test_the_start_line_names_the_registered_algorithm_and_its_settings(caplog, values, line):
    name = values.get("strategy", "fedavg")
    runner, _ = _runner([_content(_filled(1.0), 1)], get_strategy(name).server, {"num-server-rounds": 1, **values})
    with caplog.at_level("INFO", logger="flwr"):
        runner.run(runner.strategy.context.initial_arrays)
    assert line in caplog.text and "ServerStrategy" not in caplog.text


# --- FedAvgM ---------------------------------------------------------------------------------------------


def _fedavgm(momentum: float) -> FedAvgM:
    config = parse_run_config({"strategy": "fedavgm", "fedavgm-server-momentum": momentum, "fedavgm-server-lr": 1.0})
    return get_strategy("fedavgm").server(RunContext(config, _arrays(GLOBAL), None, ModelHead((), 2)))


def _replies(*models: tuple[float, int]) -> list[Reply]:
    """One reply per ``(value, examples)``: every array filled with ``value``."""
    return [
        Reply(node, node, _content(_filled(value), examples), examples) for node, (value, examples) in enumerate(models)
    ]


def test_fedavgm_with_unit_lr_and_no_momentum_equals_fedavg():
    replies = _replies((1.0, 2), (0.0, 2))
    arrays = _fedavgm(0.0).aggregate(1, replies, _arrays(GLOBAL)).arrays
    np.testing.assert_allclose(arrays["w"].numpy(), np.full((2, 3), 0.5))
    fedavg = ServerStrategy(RunContext(parse_run_config(), _arrays(GLOBAL), None, ModelHead((), 2)))
    np.testing.assert_array_equal(
        arrays["w"].numpy(), fedavg.aggregate(1, replies, _arrays(GLOBAL)).arrays["w"].numpy()
    )


def test_fedavgm_momentum_accumulates_the_pseudo_gradient():
    strategy = _fedavgm(0.5)
    first = strategy.aggregate(1, _replies((1.0, 1)), _arrays(GLOBAL)).arrays  # global 0 → 1: pseudo-gradient −1
    np.testing.assert_allclose(first["w"].numpy(), np.ones((2, 3)))
    second = strategy.aggregate(2, _replies((2.0, 1)), first).arrays
    # pseudo-gradient −1 again, momentum buffer 0.5·(−1) + (−1) = −1.5 → global 1 + 1.5
    np.testing.assert_allclose(second["w"].numpy(), np.full((2, 3), 2.5))
