"""The round recorder: one JSON line per round, client means, divergence logging, the summary."""

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from alignfl.core.rounds.runner import Participation
from alignfl.fl_app.results import RoundRecorder, plot_accuracy


def _train_record(value: float, examples: int) -> RecordDict:
    return RecordDict(
        {
            "arrays": ArrayRecord({"layer.weight": torch.full((2, 2), value)}),
            "metrics": MetricRecord({"num-examples": examples, "train-loss": value, "partition-id": 0}),
        }
    )


def _eval_record(partition: int, accuracy: float, examples: int) -> RecordDict:
    return RecordDict(
        {
            "metrics": MetricRecord(
                {"num-examples": examples, "local-accuracy": accuracy, "local-loss": 1.0, "partition-id": partition}
            )
        }
    )


def test_a_round_becomes_one_line_with_client_means(tmp_path):
    recorder = RoundRecorder(tmp_path, lambda arrays: (0.5, 0.75))
    recorder.aggregate_train([_train_record(1.0, 1), _train_record(3.0, 3)], "num-examples")
    recorder.aggregate_evaluate(
        [_eval_record(0, 0.2, 10), _eval_record(1, 0.8, 30), _eval_record(2, 0.0, 0)], "num-examples"
    )
    recorder.evaluate(1, ArrayRecord())
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["round"] == 1 and row["accuracy"] == 0.75 and row["loss"] == 0.5
    assert row["train-loss"] == pytest.approx(2.5)  # weighted by examples: (1 + 9) / 4
    assert row["clients-trained"] == 2
    assert row["clients-evaluated"] == 2  # the client with an empty local test split is left out
    assert row["local-accuracy-mean"] == pytest.approx(0.5)
    assert row["local-accuracy-weighted"] == pytest.approx(0.65)
    assert row["local-accuracy-per-client"] == {"0": 0.2, "1": 0.8}
    assert "weight-divergence" not in row


def test_weight_divergence_is_logged_when_asked(tmp_path):
    recorder = RoundRecorder(tmp_path, lambda arrays: (0.0, 0.0), log_divergence=True)
    recorder.aggregate_train([_train_record(1.0, 1), _train_record(3.0, 1)], "num-examples")
    recorder.evaluate(1, ArrayRecord())
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    # mean 2, each of 4 entries is 1 away: ‖·‖² = 4 for both clients
    assert row["weight-divergence"] == {"layer": pytest.approx(4.0)}


def test_summary_reads_final_best_and_last_five(tmp_path):
    accuracies = iter([0.1, 0.5, 0.9, 0.6, 0.7, 0.65, 0.8])
    recorder = RoundRecorder(tmp_path, lambda arrays: (1.0, next(accuracies)))
    for server_round in range(7):
        recorder.evaluate(server_round, ArrayRecord())
    summary = recorder.summary()
    assert summary["final-accuracy"] == 0.8 and summary["best-accuracy"] == 0.9 and summary["best-round"] == 2
    assert summary["last-5-best-accuracy"] == 0.9
    assert summary["last-5-mean-accuracy"] == pytest.approx(np.mean([0.9, 0.6, 0.7, 0.65, 0.8]))


def lost_node(node_id: str, address: str, remaining: int) -> str:
    """The reason the round runner gives for a client whose Ray node was lost (Flower's error text around
    alignfl.fl_app.patches.ray_pool's RayNodeLost)."""
    return (
        "the client failed (error code 0): <class 'alignfl.fl_app.patches.ray_pool.RayNodeLost'>:<'the client's actor was lost "
        f"with Ray node {node_id} ({address}) (ActorDiedError); it left the actor pool, {remaining} actor(s) "
        "remain and the next rounds train on them'>"
    )


def lacking(path: str) -> str:
    return (
        "the client failed (error code 2): <class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException "
        "ClientAppException occurred. Message: this node on Ray node 0123456789abcdef0123 (10.0.0.2) lacks the "
        f"data set: {path} is missing'>"
    )


def test_the_summary_counts_dropped_clients_by_cause_and_metrics_keep_each_reason(tmp_path):
    recorder = RoundRecorder(tmp_path, lambda arrays: (1.0, 0.5))
    dropped = [
        {},
        {"1": lost_node("a" * 56, "10.0.0.2:40123", 3), "2": lost_node("a" * 56, "10.0.0.2:40123", 2)},
        {"3": lost_node("b" * 56, "10.0.0.3:40999", 1), "0": "no reply within the round's timeout"},
        {"1": lacking("/data/MNIST/raw/train-images-idx3-ubyte"), "2": lacking("/other/MNIST/raw/t10k-labels")},
    ]
    for server_round, reasons in enumerate(dropped):
        recorder.record_participation(server_round, Participation(4, 4 - len(reasons), reasons))
        recorder.evaluate(server_round, ArrayRecord())
    counts = recorder.summary()["dropped-reasons"]
    assert sorted(counts.values()) == [1, 2, 3] and sum(counts.values()) == 6
    (lost,) = [cause for cause, count in counts.items() if count == 3]
    assert "RayNodeLost: the client's actor was lost with Ray node <id> (<address>)" in lost
    assert "<n> actor(s) remain" in lost and "error code 0" in lost
    assert counts["no reply within the round's timeout"] == 1
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("clients-dropped-reasons", {}) for line in lines] == dropped  # the detail, word for word


def test_the_server_scores_round_0_every_nth_round_and_the_last_and_the_summary_reads_those(tmp_path, caplog):
    accuracies = iter([0.1, 0.6, 0.4, 0.5])
    scored = []

    def evaluate_global(arrays):
        scored.append(True)
        return 1.0, next(accuracies)

    recorder = RoundRecorder(tmp_path, evaluate_global, server_evaluate_every=2, num_server_rounds=5)
    with caplog.at_level("INFO", logger="flwr"):
        for server_round in range(6):
            recorder.record_participation(server_round, Participation(2, 2))
            recorder.aggregate_evaluate([_eval_record(0, 0.3 + server_round / 10, 10)], "num-examples")
            recorder.evaluate(server_round, ArrayRecord())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(scored) == 4 and [line["round"] for line in lines] == [0, 1, 2, 3, 4, 5]
    assert [line["round"] for line in lines if "accuracy" in line and "loss" in line] == [0, 2, 4, 5]
    assert not any("accuracy" in line or "loss" in line for line in lines if line["round"] in (1, 3))
    assert all(line["clients-trained"] == 2 and "local-accuracy-mean" in line for line in lines)
    said = [record.getMessage() for record in caplog.records if "[alignfl] round" in record.getMessage()]
    assert said[3] == (
        "[alignfl] round 3: the server did not evaluate the global model (server-evaluate-every 2), "
        "clients' local accuracy 0.6000"
    )
    assert said[4] == "[alignfl] round 4: global accuracy 0.4000, loss 1.0000, clients' local accuracy 0.7000"
    summary = recorder.summary()
    assert summary["rounds"] == 5 and summary["final-accuracy"] == 0.5 and summary["final-loss"] == 1.0
    assert summary["best-accuracy"] == 0.6 and summary["best-round"] == 2
    assert summary["last-5-mean-accuracy"] == pytest.approx(0.5) and summary["last-5-best-accuracy"] == 0.6
    assert summary["final-local-accuracy-mean"] == pytest.approx(0.8)
    assert summary["clients-per-round"] == [2, 2, 2, 2, 2]
    plot_accuracy(recorder.rows, tmp_path / "accuracy.png", "title")
    assert (tmp_path / "accuracy.png").stat().st_size > 0
