"""Tests for fl_app/analysis: shuffle test, weight divergence, matching ratio, preference vectors, CLI."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.config import RESULTS_ENV
from core.data import load_dataset
from core.model_io import federated_state
from fl_app.analysis import (
    AnalysisError,
    capture_units,
    compare_preferences,
    divergence_by_layer,
    kept_ratio,
    matching_ratio,
    permuted_copy,
    preference_vectors,
    shuffle_permutation,
    shuffle_permutations,
    shuffle_sweep,
    shuffle_test,
    weight_divergence,
)
from fl_app.analysis.__main__ import SUBCOMMANDS, main
from fl_app.analysis.common import check_out_dir
from fl_app.analysis.shuffle import gaussian_inputs
from fl_app.config import parse_run_config
from models import PanSettings, PermutationSpec, build_model, list_models
from models.permutation import inputs_of, outputs_of

DIGITS = (1, 8, 8)
PAN_MUL = PanSettings("mul", 1.0, 0.5)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _model(name: str, pan: PanSettings | None = None, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(name, DIGITS, 10, pan).eval()


def _fixed_points(perm: torch.Tensor) -> torch.Tensor:
    return perm == torch.arange(len(perm))


# --- Algorithm 1 ----------------------------------------------------------------------


@pytest.mark.parametrize("p_sf, window", [(0.0, 1.0), (1.0, 0.0)])
def test_no_disorder_gives_the_identity(p_sf, window):
    perm = shuffle_permutation(50, p_sf, torch.Generator().manual_seed(0), window)
    assert torch.equal(perm, torch.arange(50))


def test_disorder_grows_with_p_sf_and_full_disorder_keeps_almost_nothing():
    def mean_kept(p_sf: float) -> float:
        perms = [shuffle_permutation(200, p_sf, torch.Generator().manual_seed(s)) for s in range(20)]
        for perm in perms:
            assert torch.equal(perm.sort().values, torch.arange(200))
        return sum(_fixed_points(p).float().mean().item() for p in perms) / len(perms)

    kept = [mean_kept(p) for p in (0.1, 0.3, 0.6, 1.0)]
    assert kept == sorted(kept, reverse=True)
    assert 0.75 < kept[0] < 0.95  # about (1 - p) / (1 + p) for a whole-layer window
    assert kept[-1] < 0.05  # P_sf = 1, window 1: a Fisher-Yates shuffle, ~1/J fixed points


def test_window_bounds_how_far_back_a_unit_moves():
    """A unit is moved towards the front at most once, by at most the window (w = 0.1 * 100)."""
    for seed in range(10):
        perm = shuffle_permutation(100, 1.0, torch.Generator().manual_seed(seed), window=0.1)
        assert (perm - torch.arange(100)).max() <= 10
        assert not _fixed_points(perm).all()


def test_kept_ratio_pools_all_groups():
    perms = {"a": torch.tensor([0, 2, 1, 3]), "b": torch.tensor([1, 0])}
    assert kept_ratio(perms) == 2 / 6
    model = _model("twocnn")
    drawn = shuffle_permutations(model.permutation_spec(), model.state_dict(), 0.3, torch.Generator().manual_seed(0))
    assert [len(p) for p in drawn.values()] == [32, 64, 512]
    assert kept_ratio(drawn) == sum(int(_fixed_points(p).sum()) for p in drawn.values()) / (32 + 64 + 512)


@pytest.mark.parametrize("p_sf", [-0.1, 1.5, float("nan")])
def test_p_sf_outside_unit_interval_is_refused(p_sf):
    with pytest.raises(AnalysisError, match=r"P_sf must lie in \[0, 1\]"):
        shuffle_permutation(10, p_sf, torch.Generator())


# --- shuffle error --------------------------------------------------------------------


@pytest.mark.parametrize("name", list_models())
def test_pans_off_shuffle_error_is_float_noise(name):
    model = _model(name)
    inputs = gaussian_inputs(DIGITS, 8, seed=1)
    outcome = shuffle_test(model, 1.0, inputs, repeats=1, seed=2)
    with torch.no_grad():
        scale = (model(inputs).norm(dim=1) / 10).mean().item()
    assert outcome.r_kept < 0.2
    assert outcome.error <= 1e-5 * scale


def test_p_sf_zero_keeps_every_unit_and_the_output():
    model = _model("twocnn", PAN_MUL)
    outcome = shuffle_test(model, 0.0, gaussian_inputs(DIGITS, 8, seed=1), repeats=2)
    assert outcome.r_kept == 1.0
    assert outcome.error == 0.0


def test_pans_on_shuffle_error_is_clearly_positive():
    model = _model("small-mlp", PAN_MUL)
    outcome = shuffle_test(model, 0.5, gaussian_inputs(DIGITS, 16, seed=1), repeats=2)
    assert outcome.error > 1e-3


@functools.cache
def _sweep(name: str, init: str) -> dict[tuple[str, float], float]:
    """Shuffle errors at P_sf = 1 per (mode, A); cached: two tests read the same sweeps (do not mutate)."""
    points = shuffle_sweep(
        name, DIGITS, 10, amplitudes=(0.0, 0.05, 0.5, 1.0, 2.0), p_sfs=(1.0,), repeats=1, batch=16, seed=0, init=init
    )
    return {(p.mode, p.amplitude): p.error for p in points}


@pytest.mark.parametrize("init", ["default", "he"])
@pytest.mark.parametrize("name", ["small-mlp", "twocnn", "vgg9"])
def test_shuffle_error_grows_with_a_and_faster_for_multiplicative(name, init):
    err = _sweep(name, init)
    for mode in ("add", "mul"):
        errors = [err[mode, a] for a in (0.0, 0.05, 0.5, 1.0, 2.0)]
        assert errors == sorted(errors) and len(set(errors)) == len(errors), (mode, errors)
        assert errors[1] > 1e3 * errors[0]  # A = 0 is float noise, A = 0.05 is not
    # Additive: about linear in A. Multiplicative: faster than linear (the paper's A^(L-1) term).
    for low, high in ((0.5, 1.0), (1.0, 2.0)):
        assert err["mul", high] / err["mul", low] > err["add", high] / err["add", low]
    assert err["mul", 2.0] / err["mul", 1.0] > 2.2


@pytest.mark.parametrize("name", ["small-mlp", "twocnn", "vgg9"])
def test_which_mode_is_larger_at_equal_a_depends_on_activation_scale(name):
    """Not a paper claim; pins the regime shuffle_sweep's docstring describes.

    With unit-scale activations (He init) multiplicative PANs move the output more at every
    A; with PyTorch's default init the activations are small (|h| << 1), so h * (1 + e)
    shifts less than h + e and additive PANs give the larger error up to A = 2.
    """
    he, default = _sweep(name, "he"), _sweep(name, "default")
    for a in (0.05, 0.5, 1.0, 2.0):
        assert he["mul", a] > he["add", a]
        assert default["mul", a] < default["add", a]


# --- weight divergence ----------------------------------------------------------------


def test_identical_states_have_zero_divergence():
    state = federated_state(_model("twocnn"))
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
    """weight_divergence lives in core/ (the server logs it every round), so it raises ValueError; the command
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


# --- where activations are read -------------------------------------------------------


def test_captured_activations_are_after_pan_and_relu(digits):
    model = _model("small-mlp", PAN_MUL)
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
    model = _model(name)
    with capture_units(model) as acts, torch.no_grad():
        model(torch.randn(2, *DIGITS))
    assert set(acts.raw) == set(model.permutation_spec().groups)
    assert all(acts[g].shape[:2] == (2, n) for g, n in acts.sizes.items())


@pytest.mark.parametrize("name", ["psi-vgg9", "psi-vgg11"])
def test_psinet_groups_are_captured_and_hooks_leave_the_function_alone(name):
    """A grouped conv runs its groups' modules one by one while hooked, so every group is captured."""
    model = _model(name).eval()
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
    model = _model(name, PAN_MUL)
    result = matching_ratio(model, copy.deepcopy(model), digits.test_x[:200])
    assert all(match.ratio == 1.0 for match in result.values()), result


@pytest.mark.parametrize("name", ["transformer-1", "twocnn", "small-mlp"])
def test_permuted_copy_matches_exactly_its_fixed_points(name, digits):
    """PANs off: local unit j is global unit perm[j], so only fixed points of perm sit at their index.

    Exact where every unit is active; a dead ReLU unit (zero on every digit, as in fresh
    twocnn's fcs.0) cannot be told apart from another dead one, so those groups are skipped.
    """
    model = _model(name)
    perms = shuffle_permutations(model.permutation_spec(), model.state_dict(), 0.5, torch.Generator().manual_seed(3))
    result = matching_ratio(model, permuted_copy(model, perms), digits.test_x)
    exact = {group: match for group, match in result.items() if match.inactive == 0}
    assert exact and (name != "transformer-1" or len(exact) == len(result))
    for group, match in exact.items():
        assert match.ratio == pytest.approx(_fixed_points(perms[group]).float().mean().item()), group
        assert match.mean_matched_correlation == pytest.approx(1.0)


def test_dead_units_are_reported_and_left_out_of_the_active_ratio(digits):
    model = _model("twocnn")
    perms = shuffle_permutations(model.permutation_spec(), model.state_dict(), 1.0, torch.Generator().manual_seed(3))
    x = digits.test_x
    match = matching_ratio(model, permuted_copy(model, perms), x)["fcs.0"]
    with capture_units(model) as acts, torch.no_grad():
        model(x)
    dead = acts["fcs.0"].amax(dim=(0, 2)) == 0  # post-ReLU: constant means zero everywhere
    assert dead.any()
    assert match.inactive == int((dead | dead[perms["fcs.0"]]).sum())  # local unit j is global unit perm[j]
    assert match.ratio_active <= 0.05  # P_sf = 1 moves nearly every unit, and the active ones are matched back
    assert match.ratio_active == pytest.approx(_fixed_points(perms["fcs.0"])[~dead].float().mean().item(), abs=0.02)


def test_matching_refuses_different_architectures(digits):
    with pytest.raises(AnalysisError, match="different hidden groups"):
        matching_ratio(_model("small-mlp"), _model("twonn"), digits.test_x[:10])


# --- preference vectors ---------------------------------------------------------------


def test_model_prefers_what_it_prefers(digits):
    model = _model("twocnn", PAN_MUL)
    prefs = preference_vectors(model, digits.test_x, digits.test_y, 10, samples_per_class=20)
    again = preference_vectors(model, digits.test_x, digits.test_y, 10, samples_per_class=20)
    comparison = compare_preferences(prefs, again)
    assert all(c.agreement == 1.0 and c.active > 0 for c in comparison.values())
    for matrix in prefs.values():
        norms = matrix.abs().sum(1)
        assert torch.allclose(norms[norms > 0], torch.ones(int((norms > 0).sum())))


def test_last_hidden_layer_preference_is_activation_times_classifier_weight(digits):
    """For the last hidden layer dZ_c/dA_j is the classifier weight W[c, j], so Eq. 2 is explicit."""
    model = _model("small-mlp")
    x, y = digits.test_x, digits.test_y
    raw = preference_vectors(model, x, y, 10, normalise=False)["hidden.3"]
    with torch.no_grad():
        h = x.flatten(1)
        for linear, pan in zip(model.hidden, model.pans):
            h = F.relu(pan(linear(h)))
        expected = torch.stack([h[y == c].mean(0) * model.classifier.weight[c] for c in range(10)], dim=1)
    assert torch.allclose(raw, expected, rtol=1e-4, atol=1e-6)


def test_permuted_copy_has_permuted_preferences(digits):
    model = _model("small-mlp")
    perms = shuffle_permutations(model.permutation_spec(), model.state_dict(), 1.0, torch.Generator().manual_seed(4))
    x, y = digits.test_x, digits.test_y
    prefs = preference_vectors(model, x, y, 10, samples_per_class=30)
    shuffled = preference_vectors(permuted_copy(model, perms), x, y, 10, samples_per_class=30)
    for group, perm in perms.items():
        assert torch.allclose(shuffled[group], prefs[group][perm], rtol=1e-4, atol=1e-6), group


# --- command line ---------------------------------------------------------------------


def _run_folder(path, model: str = "small-mlp", seed: int = 0, **keys):
    """A run folder as a training run leaves it: config.json and model.pt (federated state)."""
    run_config = parse_run_config({"dataset": "digits", "model": model, "seed": seed, **keys})
    torch.manual_seed(seed)
    net = build_model(model, DIGITS, 10, run_config.pan)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(run_config.to_run_config()))
    torch.save(federated_state(net), path / "model.pt")
    return path


@pytest.fixture
def runs(tmp_path):
    pan = {"pan-mode": "mul", "pan-a": 0.1}
    return _run_folder(tmp_path / "run-a", **pan), _run_folder(tmp_path / "run-b", seed=1, **pan)


@pytest.mark.parametrize("tool", sorted(SUBCOMMANDS))
def test_every_tool_documents_itself(tool, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([tool, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: python -m fl_app.analysis {tool}" in text and "--out" in text


def _end_to_end(argv: list[str], out, capsys) -> dict:
    assert main([*argv, "--out", str(out)]) == 0
    name = argv[0]
    assert (out / f"{name}.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert f"wrote {out / f'{name}.json'}" in printed
    return json.loads((out / f"{name}.json").read_text())


def test_cli_shuffle_test_sweep(tmp_path, capsys):
    result = _end_to_end(
        [
            "shuffle-test",
            "--model",
            "small-mlp",
            "--dataset",
            "digits",
            "--p-sf",
            "0",
            "1",
            "--amplitudes",
            "0",
            "0.5",
            "--repeats",
            "1",
            "--batch",
            "8",
        ],
        tmp_path / "sweep",
        capsys,
    )
    points = {(p["mode"], p["amplitude"], p["p_sf"]): p for p in result["results"]}
    assert len(points) == 2 * 2 * 2
    assert points["mul", 0.5, 0.0]["error"] == 0.0 and points["mul", 0.5, 1.0]["error"] > 1e-4


def test_cli_shuffle_test_trained_run(runs, tmp_path, capsys):
    result = _end_to_end(
        ["shuffle-test", "--run", str(runs[0]), "--p-sf", "0", "0.5", "--repeats", "1", "--batch", "8"],
        tmp_path / "trained",
        capsys,
    )
    first, second = result["results"]
    assert first["accuracy_change"] == 0.0 and first["r_kept"] == 1.0
    assert second["error"] > 0 and result["pan"] == {"mode": "mul", "period": 1.0, "amplitude": 0.1}


def test_cli_weight_divergence(runs, tmp_path, capsys):
    bare = tmp_path / "bare.pt"  # a model file without config.json: weights are all this tool reads
    bare.write_bytes((runs[1] / "model.pt").read_bytes())
    result = _end_to_end(
        ["weight-divergence", str(runs[0]), str(bare), "--weights", "1", "3"], tmp_path / "div", capsys
    )
    states = [torch.load(run / "model.pt") for run in runs]
    assert result["per_key"] == pytest.approx(weight_divergence(states, [1, 3]))
    assert list(result["per_layer"]) == ["hidden.0", "hidden.1", "hidden.2", "hidden.3", "classifier"]


def test_cli_weight_divergence_refuses_models_of_other_networks(runs, tmp_path, capsys):
    other = _run_folder(tmp_path / "run-twonn", model="twonn")
    out = tmp_path / "div"
    assert main(["weight-divergence", str(runs[0]), str(other), "--out", str(out)]) == 2
    assert "state 1 differs from state 0: missing keys" in capsys.readouterr().err
    assert not out.exists()


def test_cli_matching_ratio(runs, tmp_path, capsys):
    result = _end_to_end(
        ["matching-ratio", "--global-model", str(runs[0]), "--local-model", str(runs[0]), "--samples", "100"],
        tmp_path / "match",
        capsys,
    )
    assert result["samples"] == 100
    assert all(group["ratio"] == 1.0 for group in result["groups"].values())
    shuffled = _end_to_end(
        ["matching-ratio", "--model", "small-mlp", "--dataset", "digits", "--p-sf", "0.5"], tmp_path / "self", capsys
    )
    assert shuffled["samples"] == len(load_dataset("digits").test_y)  # 500 asked, capped at the test split
    for group, match in shuffled["groups"].items():
        if match["inactive"] == 0:
            assert match["ratio"] == pytest.approx(shuffled["shuffle_r_kept"][group])


def test_cli_preference_vectors(runs, tmp_path, capsys):
    result = _end_to_end(
        [
            "preference-vectors",
            "--model-a",
            str(runs[0]),
            "--model-b",
            str(runs[0]),
            "--samples-per-class",
            "10",
            "--layer",
            "hidden.1",
        ],
        tmp_path / "pref",
        capsys,
    )
    assert all(c["agreement"] == 1.0 for c in result["comparison"].values())
    assert len(result["preferences"]["a"]["hidden.1"]) == 100 and len(result["preferences"]["a"]["hidden.1"][0]) == 10


@pytest.mark.parametrize(
    "argv, message",
    [
        (["shuffle-test", "--run", "/nonexistent/run"], "'/nonexistent/run' does not exist"),
        (["shuffle-test", "--model", "resnet99"], "--model 'resnet99' is not known; allowed: ["),
        (["shuffle-test", "--model", "small-mlp", "--p-sf", "1.5"], "--p-sf must lie in [0, 1], got 1.5"),
        (
            ["shuffle-test", "--model", "small-mlp", "--modes", "sub"],
            "PAN mode 'sub' is not known; allowed: ['add', 'mul']",
        ),
        (["matching-ratio", "--model", "small-mlp", "--samples", "0"], "--samples must be a positive integer, got 0"),
        (["matching-ratio", "--model", "small-mlp", "--samples", "-5"], "got -5"),
        (["matching-ratio", "--model", "small-mlp", "--dataset", "imagenet"], "--dataset 'imagenet' is not known"),
        (["preference-vectors", "--model", "small-mlp", "--layer", "fc9"], "--layer 'fc9' is not a hidden group"),
        (["weight-divergence", "/nonexistent/a"], "at least 2 models, got 1"),
        (["weight-divergence", "/nonexistent/a", "/nonexistent/b"], "'/nonexistent/a' does not exist"),
    ],
)
def test_cli_bad_input_names_the_value_and_writes_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cli_refuses_relative_output_folder(capsys):
    assert main(["shuffle-test", "--model", "small-mlp", "--out", "relative/out"]) == 2
    assert "--out must be an absolute path, got 'relative/out'" in capsys.readouterr().err


def test_cli_refuses_a_folder_without_model(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert main(["matching-ratio", "--global-model", str(tmp_path / "run"), "--out", str(tmp_path / "o")]) == 2
    assert "model.pt' is missing" in capsys.readouterr().err


def test_a_tool_writes_under_the_results_root_of_every_run(tmp_path, monkeypatch):
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    assert check_out_dir(None, "merge").parent == tmp_path / "analysis"
