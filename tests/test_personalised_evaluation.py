"""Personalised evaluation: calibration errors, SuPerFed's scores over the lambda grid (oracle and honest choices),
and the recorder keeping extra client metrics as unweighted means and in the summary."""

from __future__ import annotations

import json
import math

import pytest
import torch
from flwr.app import MetricRecord, RecordDict

from alignfl.core.data import ClientData
from alignfl.core.metrics.calibration import calibration_errors
from alignfl.fl_app.results import RoundRecorder
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.superfed import (
    LAMBDA_GRID,
    SuPerFedUpdate,
)
from tests.local_updates import data, fresh_model, make_context, received, run, superfed_config


def test_calibration_errors_match_a_hand_computed_case():
    probabilities = torch.tensor([[0.95, 0.05], [0.95, 0.05], [0.40, 0.60], [0.30, 0.70]])
    labels = torch.tensor([0, 1, 1, 0])
    # Bin (0.933, 1]: conf .95, .95, acc 1/2 → gap .45; bin (0.533, 0.6]: conf .6, acc 1 → gap .4;
    # bin (0.667, 0.733]: conf .7, acc 0 → gap .7.
    ece, mce = calibration_errors(probabilities, labels)
    assert ece == pytest.approx(0.5 * 0.45 + 0.25 * 0.4 + 0.25 * 0.7)
    assert mce == pytest.approx(0.7)
    assert all(math.isnan(v) for v in calibration_errors(torch.empty(0, 2), torch.empty(0, dtype=torch.long)))


def test_personalised_evaluation_scores_the_lambda_grid_with_oracle_and_honest_choices():
    config = superfed_config(superfed_start=0.0, superfed_val_fraction=0.25)
    context, (x, y), (tx, ty) = make_context(), data(), data(40, seed=2)
    model = fresh_model()
    update = SuPerFedUpdate(config, context, received(1))
    untrained = update.evaluate(model, ClientData(x, y, tx, ty), torch.device("cpu"))
    assert untrained["superfed-local-trained"] == 0
    run(update, model, x, y)
    scores = SuPerFedUpdate(config, context, received(2)).evaluate(model, ClientData(x, y, tx, ty), torch.device("cpu"))
    assert scores["superfed-local-trained"] == 1
    assert len(scores["lambda-accuracy"]) == len(scores["lambda-ece"]) == len(LAMBDA_GRID) == 11
    plain = LocalUpdate(config, context).evaluate(model, ClientData(x, y, tx, ty), torch.device("cpu"))
    assert scores["local-accuracy"] == scores["lambda-accuracy"][0] == pytest.approx(plain["local-accuracy"])
    assert scores["local-ece"] == pytest.approx(plain["local-ece"]) and 0.0 <= plain["local-mce"] <= 1.0
    assert scores["oracle-accuracy"] == max(scores["lambda-accuracy"]) >= scores["honest-accuracy"]
    assert scores["oracle-lambda"] in LAMBDA_GRID and scores["honest-lambda"] in LAMBDA_GRID
    honest = LAMBDA_GRID.index(scores["honest-lambda"])
    assert scores["honest-ece"] == scores["lambda-ece"][honest]
    MetricRecord(scores)  # every value is a type a reply can carry


def test_recorder_keeps_extra_client_metrics_as_unweighted_means_and_in_the_summary(tmp_path):
    recorder = RoundRecorder(tmp_path, lambda arrays: (0.0, 0.5))
    replies = [
        RecordDict(
            {
                "metrics": MetricRecord(
                    {
                        "num-examples": n,
                        "partition-id": i,
                        "local-accuracy": acc,
                        "lambda-accuracy": grid,
                        "oracle-accuracy": acc + 0.1,
                    }
                )
            }
        )
        for i, (n, acc, grid) in enumerate([(10, 0.5, [0.5, 1.0]), (30, 0.7, [0.1, 0.2])])
    ]
    recorder.aggregate_evaluate(replies, "num-examples")
    recorder.evaluate(1, None)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["lambda-accuracy-mean"] == pytest.approx([0.3, 0.6])
    assert row["oracle-accuracy-mean"] == pytest.approx(0.7)
    summary = recorder.summary()
    assert summary["final-lambda-accuracy-mean"] == pytest.approx([0.3, 0.6])
    assert "final-local-accuracy-mean" in summary and "final-local-loss-mean" not in summary
