"""Analyses of hidden units on data (alignfl/fl_app/analysis): where activations are read (after PAN and ReLU, every
group of every model), the matching ratio between two models, and preference vectors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from alignfl.core.data import load_dataset
from alignfl.fl_app.analysis import (
    AnalysisError,
    capture_units,
    compare_preferences,
    matching_ratio,
    permuted_copy,
    preference_vectors,
    shuffle_permutations,
)
from alignfl.models import PermutationSpec, list_models
from alignfl.models.permutation import inputs_of, outputs_of
from tests.analysis_models import DIGITS, PAN_MUL, fixed_points, seeded_model


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


# --- where activations are read -------------------------------------------------------


def test_captured_activations_are_after_pan_and_relu(digits):
    model = seeded_model("small-mlp", PAN_MUL)
    x = digits.test_x[:5]
    with capture_units(model) as acts, torch.no_grad():
        model(x)
        first = model.pans[0](model.hidden[0](torch.flatten(x, 1)))
        assert torch.equal(acts["hidden.0"][:, :, 0], F.relu(first))
    assert {g: acts[g].shape for g in acts.raw} == {
        "hidden.0": (5, 20, 1),
        "hidden.1": (5, 100, 1),
        "hidden.2": (5, 120, 1),
        "hidden.3": (5, 84, 1),
    }


@pytest.mark.parametrize("name", list_models())
def test_every_group_of_every_model_is_captured(name):
    model = seeded_model(name)
    with capture_units(model) as acts, torch.no_grad():
        model(torch.randn(2, *DIGITS))
    assert set(acts.raw) == set(model.permutation_spec().groups)
    assert all(acts[g].shape[:2] == (2, n) for g, n in acts.sizes.items())


@pytest.mark.parametrize("name", ["psi-vgg9", "psi-vgg11"])
def test_psinet_groups_are_captured_and_hooks_leave_the_function_alone(name):
    """A grouped conv runs its groups' modules one by one while hooked, so every group is captured."""
    model = seeded_model(name).eval()
    x = torch.randn(2, *DIGITS)
    with torch.no_grad():
        plain = model(x)
        with capture_units(model) as acts:
            hooked = model(x)
    torch.testing.assert_close(hooked, plain, rtol=1e-5, atol=1e-6)
    assert set(acts.raw) == set(model.permutation_spec().groups)
    assert all(acts[g].shape[:2] == (2, n) for g, n in acts.sizes.items())
    first_grouped = model.depth  # branches: every group reads all shared channels; later ones their own slice
    assert acts.raw[f"convs.{first_grouped - 1}"].shape[1] == model.convs[first_grouped - 1].out_channels
    group_input = acts.raw[f"convs.{first_grouped}.groups.1"]
    assert group_input.shape[1] == model.convs[first_grouped].groups[1].out_channels


class _Bypass(nn.Module):
    """A hidden layer whose only reader is applied through its weights (``F.linear``): that module never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, 5)
        self.classifier = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(x.flatten(1)))
        return nn.functional.linear(h, self.classifier.weight, self.classifier.bias)

    def permutation_spec(self) -> PermutationSpec:
        return PermutationSpec({"hidden": outputs_of("hidden") + inputs_of("classifier")})


def test_groups_of_layers_that_never_run_are_refused_by_name(digits):
    model = _Bypass()
    with capture_units(model) as acts, torch.no_grad():
        model(torch.randn(2, *DIGITS))
    with pytest.raises(AnalysisError, match="'hidden' were not captured"):
        acts["hidden"]
    with pytest.raises(AnalysisError, match="not captured"):
        matching_ratio(model, model, digits.test_x[:10])


# --- matching ratio -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["small-mlp", "twocnn", "vgg9"])
def test_identical_models_match_completely(name, digits):
    model = seeded_model(name, PAN_MUL)
    result = matching_ratio(model, copy.deepcopy(model), digits.test_x[:200])
    assert all(match.ratio == 1.0 for match in result.values()), result


@pytest.mark.parametrize("name", ["transformer-1", "twocnn", "small-mlp"])
def test_permuted_copy_matches_exactly_its_fixed_points(name, digits):
    """PANs off: local unit j is global unit perm[j], so only fixed points of perm sit at their index.

    Exact where every unit is active; a dead ReLU unit (zero on every digit, as in fresh
    twocnn's fcs.0) cannot be told apart from another dead one, so those groups are skipped.
    """
    model = seeded_model(name)
    perms = shuffle_permutations(model.permutation_spec(), model.state_dict(), 0.5, torch.Generator().manual_seed(3))
    result = matching_ratio(model, permuted_copy(model, perms), digits.test_x)
    exact = {group: match for group, match in result.items() if match.inactive == 0}
    assert exact and (name != "transformer-1" or len(exact) == len(result))
    for group, match in exact.items():
        assert match.ratio == pytest.approx(fixed_points(perms[group]).float().mean().item()), group
        assert match.mean_matched_correlation == pytest.approx(1.0)


def test_dead_units_are_reported_and_left_out_of_the_active_ratio(digits):
    model = seeded_model("twocnn")
    perms = shuffle_permutations(model.permutation_spec(), model.state_dict(), 1.0, torch.Generator().manual_seed(3))
    x = digits.test_x
    match = matching_ratio(model, permuted_copy(model, perms), x)["fcs.0"]
    with capture_units(model) as acts, torch.no_grad():
        model(x)
    dead = acts["fcs.0"].amax(dim=(0, 2)) == 0  # post-ReLU: constant means zero everywhere
    assert dead.any()
    assert match.inactive == int((dead | dead[perms["fcs.0"]]).sum())  # local unit j is global unit perm[j]
    assert match.ratio_active <= 0.05  # P_sf = 1 moves nearly every unit, and the active ones are matched back
    assert match.ratio_active == pytest.approx(fixed_points(perms["fcs.0"])[~dead].float().mean().item(), abs=0.02)


def test_matching_refuses_different_architectures(digits):
    with pytest.raises(AnalysisError, match="different hidden groups"):
        matching_ratio(seeded_model("small-mlp"), seeded_model("twonn"), digits.test_x[:10])


# --- preference vectors ---------------------------------------------------------------


def test_model_prefers_what_it_prefers(digits):
    model = seeded_model("twocnn", PAN_MUL)
    prefs = preference_vectors(model, digits.test_x, digits.test_y, 10, samples_per_class=20)
    again = preference_vectors(model, digits.test_x, digits.test_y, 10, samples_per_class=20)
    comparison = compare_preferences(prefs, again)
    assert all(c.agreement == 1.0 and c.active > 0 for c in comparison.values())
    for matrix in prefs.values():
        norms = matrix.abs().sum(1)
        assert torch.allclose(norms[norms > 0], torch.ones(int((norms > 0).sum())))


def test_last_hidden_layer_preference_is_activation_times_classifier_weight(digits):
    """For the last hidden layer dZ_c/dA_j is the classifier weight W[c, j], so Eq. 2 is explicit."""
    model = seeded_model("small-mlp")
    x, y = digits.test_x, digits.test_y
    raw = preference_vectors(model, x, y, 10, normalise=False)["hidden.3"]
    with torch.no_grad():
        h = x.flatten(1)
        for linear, pan in zip(model.hidden, model.pans):
            h = F.relu(pan(linear(h)))
        expected = torch.stack([h[y == c].mean(0) * model.classifier.weight[c] for c in range(10)], dim=1)
    assert torch.allclose(raw, expected, rtol=1e-4, atol=1e-6)


def test_permuted_copy_has_permuted_preferences(digits):
    model = seeded_model("small-mlp")
    perms = shuffle_permutations(model.permutation_spec(), model.state_dict(), 1.0, torch.Generator().manual_seed(4))
    x, y = digits.test_x, digits.test_y
    prefs = preference_vectors(model, x, y, 10, samples_per_class=30)
    shuffled = preference_vectors(permuted_copy(model, perms), x, y, 10, samples_per_class=30)
    for group, perm in perms.items():
        assert torch.allclose(shuffled[group], prefs[group][perm], rtol=1e-4, atol=1e-6), group
