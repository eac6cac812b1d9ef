"""New (held-out) clients and learning-rate decay: held-out partitions are evaluated but never trained, and scored
apart; the learning rate decays per round, in every optimizer override too."""

from __future__ import annotations

import json
import math

import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict

from alignfl.core.rounds.runner import MetricAggregation, RoundRunner
from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.config import ConfigError, build_context, parse_run_config
from alignfl.fl_app.inprocess import InProcessGrid
from alignfl.fl_app.results import RoundRecorder
from alignfl.strategies import get_strategy
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.superfed import (
    SuPerFedUpdate,
)
from tests.local_updates import (
    assert_same_state,
    config_of,
    data,
    fresh_model,
    make_context,
    received,
    run,
    superfed_config,
)


def test_config_refuses_bad_holdout_and_lr_decay_values():
    for values in [
        {"holdout-clients": -1},
        {"holdout-clients": 2, "min-available-nodes": 2},
        {"lr-decay": 0.0},
        {"lr-decay": 1.5},
        {"lr-decay": math.nan},
    ]:
        key = next(k for k in values if k != "min-available-nodes")
        with pytest.raises(ConfigError, match=f"'{key}'"):
            parse_run_config(values)
    assert parse_run_config({"holdout-clients": 1, "min-available-nodes": 2}).holdout_clients == 1


class _RecordingGrid(InProcessGrid):
    """Six in-process nodes holding partitions 0..5 of 6: they answer the server's partition query and note
    every other message they get, by its type and their partition, without answering it."""

    def __init__(self) -> None:
        super().__init__(build_client_app(), num_nodes=6)
        self.received: list[tuple[str, int]] = []

    def deliver(self, message: Message) -> Message | None:
        if message.metadata.message_type == MessageType.QUERY:
            return super().deliver(message)
        partition = int(self.contexts[message.metadata.dst_node_id].node_config["partition-id"])
        self.received.append((message.metadata.message_type, partition))
        return None


@pytest.mark.parametrize("strategy", ["fedavg", "superfed", "scaffold"])
def test_held_out_partitions_are_never_sampled_for_training_but_are_evaluated(strategy):
    fold = lambda records, key: MetricRecord()  # noqa: E731
    config = config_of(strategy=strategy, dataset="digits", model="small-mlp", holdout_clients=2, min_available_nodes=6)
    server = get_strategy(strategy).server(build_context(config, fresh_model()))
    grid = _RecordingGrid()
    runner = RoundRunner(server, grid, MetricAggregation(fold, fold))
    arrays = server.context.initial_arrays
    assert runner.train_round(1, arrays) is arrays  # nobody answers: the global model stays
    runner.evaluate_round(1, arrays)
    trained = sorted(partition for kind, partition in grid.received if kind == MessageType.TRAIN)
    evaluated = sorted(partition for kind, partition in grid.received if kind == MessageType.EVALUATE)
    assert trained == [0, 1, 2, 3]  # partitions 4 and 5 of 6 are the new clients
    assert evaluated == [0, 1, 2, 3, 4, 5]


def test_recorder_scores_new_clients_apart_from_the_trained_ones(tmp_path):
    recorder = RoundRecorder(tmp_path, lambda arrays: (0.0, 0.5))
    trained = [
        RecordDict(
            {
                "metrics": MetricRecord(
                    {
                        "num-examples": 10,
                        "partition-id": i,
                        "local-accuracy": acc,
                        "local-ece": 0.1,
                        "lambda-accuracy": [acc, acc],
                        "new-client": 0,
                    }
                )
            }
        )
        for i, acc in enumerate([0.9, 0.7])
    ]
    new = [
        RecordDict(
            {
                "metrics": MetricRecord(
                    {
                        "num-examples": n,
                        "partition-id": 2 + i,
                        "local-accuracy": acc,
                        "local-ece": ece,
                        "local-mce": 0.3,
                        "new-client": 1,
                    }
                )
            }
        )
        for i, (n, acc, ece) in enumerate([(10, 0.2, 0.4), (30, 0.4, 0.2)])
    ]
    recorder.aggregate_evaluate(trained + new, "num-examples")
    recorder.evaluate(1, None)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["clients-evaluated"] == 2 and row["new-clients-evaluated"] == 2
    assert row["local-accuracy-mean"] == pytest.approx(0.8) and row["lambda-accuracy-mean"] == pytest.approx([0.8, 0.8])
    assert row["new-client-accuracy"] == pytest.approx(0.3)  # mean over new clients, not weighted by examples
    assert (row["new-client-ece"], row["new-client-mce"]) == (pytest.approx(0.3), pytest.approx(0.3))
    assert recorder.summary()["final-new-client-accuracy"] == pytest.approx(0.3)
    assert "new-client-mean" not in row  # a flag, not a score


def test_learning_rate_decays_per_round_and_needs_the_round():
    config = superfed_config(lr_decay=0.5)
    assert LocalUpdate(config, make_context(), received(3)).learning_rate() == pytest.approx(0.05 * 0.25)
    assert LocalUpdate(config.replace(lr_decay=1.0), make_context()).learning_rate() == 0.05
    with pytest.raises(ValueError, match="server-round"):
        LocalUpdate(config, make_context()).learning_rate()


def test_a_decayed_round_trains_exactly_like_the_decayed_learning_rate():
    x, y = data()
    decayed, plain = fresh_model(), fresh_model()
    run(LocalUpdate(superfed_config(lr_decay=0.9), make_context(), received(4)), decayed, x, y)
    run(LocalUpdate(superfed_config(lr=0.05 * 0.9**3), make_context(), received(4)), plain, x, y)
    assert_same_state(decayed, plain)


def test_every_optimizer_override_uses_the_decayed_learning_rate():
    from alignfl.strategies.ditto import _PersonalStep
    from alignfl.strategies.psinet import PsiNetUpdate

    config = superfed_config(lr_decay=0.5, superfed_start=0.0)
    expected = 0.05 * 0.5**2
    superfed = SuPerFedUpdate(config, make_context(), received(3))
    model = fresh_model()
    superfed.begin(model)
    psinet = PsiNetUpdate(config, make_context(), received(3))
    psinet._keys = [name for name, _ in model.named_parameters()]
    for optimizer in (
        superfed.optimizer(model),
        psinet.optimizer(model),
        _PersonalStep(config, [], received(3)).optimizer(model),
    ):
        assert optimizer.lr == pytest.approx(expected)
