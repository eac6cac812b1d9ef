"""Weight divergence (alignfl/fl_app/analysis): zero for identical states, a hand-computed case, inputs left alone,
mismatched inputs refused."""

from __future__ import annotations

import copy

import pytest
import torch

from alignfl.core.model_io import federated_state
from alignfl.fl_app.analysis import (
    divergence_by_layer,
    weight_divergence,
)
from tests.analysis_models import seeded_model


def test_identical_states_have_zero_divergence():
    state = federated_state(seeded_model("twocnn"))
    divergence = weight_divergence([state, copy.deepcopy(state), state])
    assert set(divergence) == set(state)
    assert all(value == 0.0 for value in divergence.values())


def test_divergence_matches_hand_computation():
    a = {
        "layer.weight": torch.tensor([1.0, 2.0]),
        "layer.bias": torch.tensor([0.0]),
        "bn.num_batches_tracked": torch.tensor(3),
    }
    b = {
        "layer.weight": torch.tensor([3.0, 6.0]),
        "layer.bias": torch.tensor([2.0]),
        "bn.num_batches_tracked": torch.tensor(9),
    }
    # Equal weights: mean (2, 4) and 1; each model is 1 + 4 (weight) and 1 (bias) away.
    assert weight_divergence([a, b]) == pytest.approx({"layer.weight": 5.0, "layer.bias": 1.0})
    # Weights 3:1: mean (1.5, 3) and 0.5; (3 * 1.25 + 11.25) / 4 and (3 * 0.25 + 2.25) / 4.
    weighted = weight_divergence([a, b], weights=[30, 10])
    assert weighted == pytest.approx({"layer.weight": 3.75, "layer.bias": 0.75})
    assert divergence_by_layer(weighted) == pytest.approx({"layer": 4.5})


def test_divergence_leaves_inputs_alone_and_takes_numpy():
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    b = {"w": torch.tensor([3.0, 6.0], dtype=torch.float64).numpy()}
    assert weight_divergence([a, b], weights=[1, 2]) == pytest.approx({"w": 20 * 2 / 9})
    assert a["w"].tolist() == [1.0, 2.0] and b["w"].tolist() == [3.0, 6.0]


def test_divergence_refuses_mismatched_inputs():
    """weight_divergence lives in alignfl/core/ (the server logs it every round), so it raises ValueError; the command
    line turns that into its own error (test_cli_weight_divergence_refuses_models_of_other_networks)."""
    a = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"state 1 differs from state 0: missing keys \['w'\], extra keys \['v'\]"):
        weight_divergence([a, {"v": torch.zeros(2)}])
    with pytest.raises(ValueError, match=r"'w' has shape \(3,\), state 0 has \(2,\)"):
        weight_divergence([a, {"w": torch.zeros(3)}])
    with pytest.raises(ValueError, match="one per model"):
        weight_divergence([a, a], weights=[1.0])
    with pytest.raises(ValueError, match="not all zero"):
        weight_divergence([a, a], weights=[0.0, 0.0])
