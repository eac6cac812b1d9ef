"""The OT fusion engine (alignfl/core/merging/ot_fusion.py): permuted copies, agreement with the Hungarian matcher,
Sinkhorn's approach to exact OT, and fusion across widths."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from alignfl.core.merging.alignment import find_permutations, inner_products, solve_group
from alignfl.core.merging.ot_fusion import (
    OTSettings,
    Transport,
    align_onto,
    as_permutations,
    carry_state,
    ot_fuse,
    transport_maps,
)
from alignfl.models import build_model, invert_permutations, permute_state, random_permutations

# (model, input shape, options): every family with a permutation description
MODELS = [
    ("small-mlp", (1, 8, 8), {}),
    ("vgg9-bn", (3, 32, 32), {"width_factor": 0.25}),
    ("resnet20", (3, 32, 32), {}),
    ("psi-vgg9", (3, 32, 32), {"width_factor": 0.25}),
    ("mobilenet", (3, 32, 32), {"width_factor": 0.25}),
    ("transformer-1", (1, 8, 8), {}),
]


def _state(name: str, shape: tuple, seed: int = 0, **options) -> tuple:
    torch.manual_seed(seed)
    model = build_model(name, shape, 10, **options)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, value in state.items():  # running statistics that differ from channel to channel
        if "running" in key:
            state[key] = value + torch.rand_like(value)
    return model, model.permutation_spec(), state


def _forward(model: torch.nn.Module, state: dict, x: torch.Tensor) -> torch.Tensor:
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize(("name", "shape", "options"), MODELS, ids=[m[0] for m in MODELS])
def test_exact_ot_recovers_a_permuted_copy_as_the_hungarian_matcher_does_and_fuses_it_back(name, shape, options):
    _, spec, state = _state(name, shape, **options)
    perms = random_permutations(spec, state, torch.Generator().manual_seed(1))
    copy = permute_state(spec, state, perms)
    aligned, transport = align_onto(state, copy, spec, OTSettings())
    found = as_permutations(transport)
    hungarian = find_permutations(state, copy, spec, "weight")
    expected = invert_permutations(perms)
    assert all(torch.equal(found[g], expected[g]) and torch.equal(found[g], hungarian[g]) for g in spec.groups)
    assert all(torch.allclose(aligned[k], state[k], atol=1e-5) for k in state if state[k].is_floating_point())
    fused, _ = ot_fuse(state, [copy, state], [3.0, 1.0], spec, OTSettings())
    assert all(torch.allclose(fused[k], state[k], atol=1e-5) for k in state if state[k].is_floating_point())
    assert all(t.off_diagonal()[g] > 0.5 for t in [transport] for g in spec.groups if len(perms[g]) > 4)


def test_exact_ot_between_unrelated_models_picks_the_hungarian_assignment_of_the_same_cost():
    """Squared euclidean cost on raw rows: its exact OT plan is the assignment that maximises inner products
    (the norms add up to the same total under every permutation), group after group."""
    _, spec, reference = _state("small-mlp", (1, 8, 8), seed=0)
    _, _, other = _state("small-mlp", (1, 8, 8), seed=1)
    settings = OTSettings(squared=True, normalize_weights=False)
    found = as_permutations(transport_maps(reference, other, spec, settings))
    solved: dict[str, torch.Tensor] = {}
    for group in ["hidden.0", "hidden.1", "hidden.2"]:  # the last one's Hungarian cost also reads the classifier
        solved[group] = solve_group(reference, other, spec, group, solved, inner_products)
        assert torch.equal(found[group], solved[group]), group
    assert any(not torch.equal(p, torch.arange(len(p))) for p in solved.values())  # a real reordering


@pytest.mark.filterwarnings("ignore:Sinkhorn did not converge")  # POT's 1,000 iterations (the authors' default)
def test_sinkhorn_approaches_exact_ot_as_its_regularisation_shrinks():
    _, spec, reference = _state("small-mlp", (1, 8, 8), seed=0)
    _, _, other = _state("small-mlp", (1, 8, 8), seed=1)
    exact = transport_maps(reference, other, spec, OTSettings()).couplings["hidden.0"]
    gaps = []
    for reg in (0.3, 0.1, 0.03, 0.01, 0.003):
        soft = transport_maps(reference, other, spec, OTSettings(exact=False, reg=reg)).couplings["hidden.0"]
        assert torch.allclose(soft.sum(0), exact.sum(0), atol=1e-4)  # both honour the marginals
        gaps.append(float((soft - exact).abs().sum()))
    assert all(a > b for a, b in zip(gaps, gaps[1:])) and gaps[-1] < 0.2 * gaps[0]
    assert gaps[0] > 0.5  # a strong regularisation spreads the mass (the plan is not the permutation)
    assert torch.equal(soft.argmax(0), exact.argmax(0))  # reg 0.003: every unit's largest share is exact OT's


def _duplicated(spec, state, settings: OTSettings) -> dict:
    """``state`` at twice its widths: every hidden unit twice (incoming weights copied, outgoing halved)."""
    splits = {
        g: torch.kron(torch.eye(n), torch.ones(1, 2)).double() / (2 * n) for g, n in spec.group_sizes(state).items()
    }
    return carry_state(state, spec, Transport(splits, settings))


def test_a_model_fused_into_twice_its_width_keeps_its_function_and_comes_back_from_it():
    model, spec, narrow = _state("small-mlp", (1, 8, 8), width_factor=0.5)
    settings = OTSettings()
    noise = torch.Generator().manual_seed(3)
    wide_reference = {
        k: v + 1e-3 * torch.randn(v.shape, generator=noise) for k, v in _duplicated(spec, narrow, settings).items()
    }
    wide, transport = align_onto(wide_reference, narrow, spec, settings)
    assert spec.group_sizes(wide) == {g: 2 * n for g, n in spec.group_sizes(narrow).items()}
    assert not transport.off_diagonal()  # no square map: every group changed width
    x = torch.randn(16, 1, 8, 8, generator=noise)
    wide_model = build_model("small-mlp", (1, 8, 8), 10)
    assert torch.allclose(_forward(wide_model, wide, x), _forward(model, narrow, x), atol=1e-5)
    back, _ = align_onto(narrow, wide, spec, settings)
    assert all(torch.allclose(back[k], narrow[k], atol=1e-6) for k in narrow)
    # the authors' code carries the outgoing weights by the column-normalised map: the next layer sees twice the input
    authors, _ = align_onto(wide_reference, narrow, spec, dataclasses.replace(settings, split_outgoing=False))
    assert not torch.allclose(_forward(wide_model, authors, x), _forward(model, narrow, x), atol=1e-2)


def test_without_correction_the_fused_layers_shrink_and_without_past_correction_widths_must_match():
    _, spec, state = _state("small-mlp", (1, 8, 8))
    copy = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(1)))
    raw, _ = align_onto(state, copy, spec, OTSettings(correction=False))
    assert torch.allclose(raw["hidden.0.weight"], state["hidden.0.weight"] / 20, atol=1e-6)  # 20 units: T = P / 20
    _, _, narrow = _state("small-mlp", (1, 8, 8), width_factor=0.5)
    with pytest.raises(ValueError, match="past-correction=false needs equal widths"):
        align_onto(state, narrow, spec, OTSettings(past_correction=False))


def test_states_that_differ_outside_the_groups_or_a_diverging_sinkhorn_are_refused():
    _, spec, state = _state("small-mlp", (1, 8, 8))
    _, _, other = _state("small-mlp", (1, 16, 16))  # the first layer's inputs differ: no group's axis
    with pytest.raises(ValueError, match="'hidden.0.weight' has shape .* only the widths of permutation groups"):
        transport_maps(state, other, spec, OTSettings())
    big = {k: 1e4 * v for k, v in state.items()}
    settings = OTSettings(exact=False, reg=1e-4, normalize_weights=False, squared=True)
    with pytest.raises(ValueError, match="otfusion-reg=0.0001 gave no finite transport map"), pytest.warns(UserWarning):
        transport_maps(state, big, spec, settings)


def test_importance_marginals_give_a_soft_plan_whose_mass_follows_the_units_norms():
    _, spec, state = _state("small-mlp", (1, 8, 8))
    _, _, other = _state("small-mlp", (1, 8, 8), seed=1)
    coupling = transport_maps(state, other, spec, OTSettings(marginals="l2")).couplings["hidden.0"]
    norms = torch.cat([other["hidden.0.weight"], other["hidden.0.bias"][:, None]], 1).double().norm(dim=1)
    assert torch.allclose(coupling.sum(1), norms / norms.sum(), atol=1e-6)
