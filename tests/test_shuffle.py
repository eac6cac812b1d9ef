"""The shuffle test (alignfl/fl_app/analysis): Algorithm 1's permutations (disorder grows with p_sf, a window bounds how
far a unit moves) and the shuffle error of every model, float noise without PANs and growing with a, faster for
multiplicative PANs."""

from __future__ import annotations

import functools

import pytest
import torch

from alignfl.fl_app.analysis import (
    AnalysisError,
    kept_ratio,
    shuffle_permutation,
    shuffle_permutations,
    shuffle_sweep,
    shuffle_test,
)
from alignfl.fl_app.analysis.shuffle import gaussian_inputs
from alignfl.models import list_models
from tests.analysis_models import DIGITS, PAN_MUL, fixed_points, seeded_model

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
        return sum(fixed_points(p).float().mean().item() for p in perms) / len(perms)

    kept = [mean_kept(p) for p in (0.1, 0.3, 0.6, 1.0)]
    assert kept == sorted(kept, reverse=True)
    assert 0.75 < kept[0] < 0.95  # about (1 - p) / (1 + p) for a whole-layer window
    assert kept[-1] < 0.05  # P_sf = 1, window 1: a Fisher-Yates shuffle, ~1/J fixed points


def test_window_bounds_how_far_back_a_unit_moves():
    """A unit is moved towards the front at most once, by at most the window (w = 0.1 * 100)."""
    for seed in range(10):
        perm = shuffle_permutation(100, 1.0, torch.Generator().manual_seed(seed), window=0.1)
        assert (perm - torch.arange(100)).max() <= 10
        assert not fixed_points(perm).all()


def test_kept_ratio_pools_all_groups():
    perms = {"a": torch.tensor([0, 2, 1, 3]), "b": torch.tensor([1, 0])}
    assert kept_ratio(perms) == 2 / 6
    model = seeded_model("twocnn")
    drawn = shuffle_permutations(model.permutation_spec(), model.state_dict(), 0.3, torch.Generator().manual_seed(0))
    assert [len(p) for p in drawn.values()] == [32, 64, 512]
    assert kept_ratio(drawn) == sum(int(fixed_points(p).sum()) for p in drawn.values()) / (32 + 64 + 512)


@pytest.mark.parametrize("p_sf", [-0.1, 1.5, float("nan")])
def test_p_sf_outside_unit_interval_is_refused(p_sf):
    with pytest.raises(AnalysisError, match=r"P_sf must lie in \[0, 1\]"):
        shuffle_permutation(10, p_sf, torch.Generator())


# --- shuffle error --------------------------------------------------------------------


@pytest.mark.parametrize("name", list_models())
def test_pans_off_shuffle_error_is_float_noise(name):
    model = seeded_model(name)
    inputs = gaussian_inputs(DIGITS, 8, seed=1)
    outcome = shuffle_test(model, 1.0, inputs, repeats=1, seed=2)
    with torch.no_grad():
        scale = (model(inputs).norm(dim=1) / 10).mean().item()
    assert outcome.r_kept < 0.2
    assert outcome.error <= 1e-5 * scale


def test_p_sf_zero_keeps_every_unit_and_the_output():
    model = seeded_model("twocnn", PAN_MUL)
    outcome = shuffle_test(model, 0.0, gaussian_inputs(DIGITS, 8, seed=1), repeats=2)
    assert outcome.r_kept == 1.0
    assert outcome.error == 0.0


def test_pans_on_shuffle_error_is_clearly_positive():
    model = seeded_model("small-mlp", PAN_MUL)
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
