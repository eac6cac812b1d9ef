"""The alignment engine: permuted copies are aligned back exactly, for every model and every cost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from alignfl.core.merging.alignment import (
    align,
    align_and_average,
    best_assignment,
    find_permutations,
    list_costs,
    unit_rows,
    weighted_average,
)
from alignfl.models import (
    PanSettings,
    build_model,
    invert_permutations,
    list_models,
    permute_state,
    random_permutations,
)
from alignfl.models.permutation import permute_axis, unit_view

ALL_MODELS = list_models()
COSTS = list_costs()
WIDE = {"mlp", "vgg11", "psi-vgg11", "mobilenet", "psi-mobilenet"}
"""Models whose L1 score takes seconds (O(J² d) per group): the L1 cost is checked on the narrower ones."""
PAIRS = [(name, cost) for name in ALL_MODELS for cost in COSTS if cost != "l1" or name not in WIDE]
SHAPE = (1, 8, 8)
PAN_ON = PanSettings(mode="mul", period=1.0, amplitude=0.5)


def _state(name: str, pan: PanSettings | None = None, seed: int = 1) -> tuple:
    """A model's spec and state, with per-channel normalisation entries made distinct.

    Default BatchNorm/LayerNorm values are equal for every channel, so a wrongly
    permuted one would go unnoticed; random values make every entry count.
    """
    torch.manual_seed(seed)
    model = build_model(name, SHAPE, 3, pan)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.BatchNorm2d, nn.LayerNorm)):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.2)
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0.0, 0.2)
                module.running_var.uniform_(0.5, 2.0)
    return model.permutation_spec(), model.state_dict()


def _permuted(spec, state, seed: int = 2):
    perms = random_permutations(spec, state, torch.Generator().manual_seed(seed))
    return perms, permute_state(spec, state, perms)


def _assert_states_equal(actual, expected, exact: bool = True):
    assert actual.keys() == expected.keys()
    for key in expected:
        if exact:
            assert torch.equal(actual[key], expected[key]), key
        else:
            torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


# PANs change no state-dict entry (encodings are non-persistent buffers), so a PAN model's state is
# aligned exactly like a plain one; the PAN-on case runs with one cost to keep the suite quick.
@pytest.mark.parametrize(
    ("name", "cost", "pan"),
    [*((name, cost, None) for name, cost in PAIRS), *((name, "weight", PAN_ON) for name in ALL_MODELS)],
    ids=[*(f"{name}-{cost}-pan-off" for name, cost in PAIRS), *(f"{name}-weight-pan-on" for name in ALL_MODELS)],
)
def test_permuted_copy_is_aligned_back_exactly(name, cost, pan):
    spec, state = _state(name, pan)
    applied, permuted = _permuted(spec, state)
    assert any(not torch.equal(permuted[k], state[k]) for k in state)

    found = find_permutations(state, permuted, spec, cost)
    expected = invert_permutations(applied)
    assert found.keys() == expected.keys()
    wrong = [group for group in expected if not torch.equal(found[group], expected[group])]
    assert not wrong, f"{cost} failed to recover groups {wrong}"
    _assert_states_equal(permute_state(spec, permuted, found), state)


@pytest.mark.parametrize(("name", "cost"), PAIRS)
def test_matched_average_of_a_model_and_its_permuted_copy_is_the_model(name, cost):
    spec, state = _state(name)
    _, permuted = _permuted(spec, state)
    matched = align_and_average(state, [state, permuted], [1.0, 3.0], spec, cost)[0]
    _assert_states_equal(matched, state, exact=False)

    plain = weighted_average([state, permuted], [1.0, 3.0])  # the test can fail: plain averaging mixes units
    differs = [k for k in spec.axes_by_key() if not torch.allclose(plain[k], state[k], rtol=1e-3, atol=1e-4)]
    assert differs


@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("name", ["small-mlp", "twocnn", "resnet20", "transformer-1"])
def test_a_noisy_permuted_copy_is_still_recovered(name, cost):
    spec, state = _state(name)
    applied, permuted = _permuted(spec, state)
    noise = torch.Generator().manual_seed(5)
    noisy = {
        k: v + 1e-3 * v.std() * torch.randn(v.shape, generator=noise)
        if torch.is_floating_point(v) and v.numel() > 1
        else v
        for k, v in permuted.items()
    }
    found = find_permutations(state, noisy, spec, cost)
    expected = invert_permutations(applied)
    assert all(torch.equal(found[g], expected[g]) for g in expected)


@pytest.mark.parametrize("name", ["small-mlp", "resnet20"])
def test_iterating_against_the_matched_mean_keeps_the_exact_answer(name):
    spec, state = _state(name)
    copies = [_permuted(spec, state, seed)[1] for seed in (2, 3, 4)]
    start = _state(name, seed=7)[1]  # an unrelated reference only fixes the first unit order
    matched = align_and_average(start, copies, [1.0, 2.0, 3.0], spec, "weight", iterations=3)[0]
    aligned_back = align(state, matched, spec)
    _assert_states_equal(aligned_back, state, exact=False)


@pytest.mark.parametrize("name", ["vgg9", "twocnn", "resnet20", "transformer-1"])
def test_unit_rows_equal_permuting_then_viewing(name):
    """The one-copy row builder agrees with permute_axis + unit_view, flattened blocks included."""
    torch.manual_seed(0)
    model = build_model(name, (1, 16, 16), 3)  # 16 x 16: the conv nets flatten blocks of H*W > 1
    spec, state = model.permutation_spec(), model.state_dict()
    assert name in ("resnet20", "transformer-1") or any(r.block > 1 for refs in spec.groups.values() for r in refs)
    perms = random_permutations(spec, state, torch.Generator().manual_seed(3))
    for key, refs in spec.axes_by_key().items():
        for _, ref in refs:
            moves = [(other, perms[group]) for group, other in refs if other.axis != ref.axis]
            expected = state[key]
            for other, perm in moves:
                expected = permute_axis(expected, other, perm)
            assert torch.equal(unit_rows(state[key], ref, moves), unit_view(expected, ref).float()), (key, ref)


def test_entries_outside_the_spec_are_never_changed():
    spec, state = _state("resnet20")
    _, permuted = _permuted(spec, state)
    permuted["blocks.0.bn1.num_batches_tracked"] = torch.tensor(17)
    aligned = align(state, permuted, spec)
    assert torch.equal(aligned["classifier.bias"], permuted["classifier.bias"])
    assert aligned["blocks.0.bn1.num_batches_tracked"].item() == 17


def test_ties_keep_the_current_order():
    """A model aligned onto itself stays as it is even when two units are identical (a tie)."""
    spec, state = _state("small-mlp")
    state = dict(state)
    for key, axis in (("hidden.1.weight", 0), ("hidden.1.bias", 0), ("hidden.2.weight", 1)):
        index = [slice(None)] * state[key].dim()
        index[axis] = 1
        source = list(index)
        source[axis] = 0
        state[key] = state[key].clone()
        state[key][tuple(index)] = state[key][tuple(source)]
    for cost in COSTS:
        found = find_permutations(state, state, spec, cost)
        assert all(torch.equal(perm, torch.arange(perm.numel())) for perm in found.values()), cost


def test_unknown_cost_lists_the_allowed_ones():
    spec, state = _state("small-mlp")
    with pytest.raises(ValueError, match=r"unknown alignment cost 'l3'.*'l1'.*'weight'"):
        align(state, state, spec, cost="l3")


def test_states_of_different_shapes_are_refused_by_name():
    spec, state = _state("small-mlp")
    other = dict(state, **{"hidden.1.bias": torch.zeros(99)})
    with pytest.raises(ValueError, match=r"'hidden.1.bias' has shape \(99,\)"):
        align(state, other, spec)
    with pytest.raises(ValueError, match=r"missing \['classifier.bias'\]"):
        align(state, {k: v for k, v in state.items() if k != "classifier.bias"}, spec)


def test_weighted_average_weights_by_examples():
    a, b = {"w": torch.zeros(2), "n": torch.tensor(3)}, {"w": torch.ones(2), "n": torch.tensor(5)}
    averaged = weighted_average([a, b], [1, 3])
    torch.testing.assert_close(averaged["w"], torch.full((2,), 0.75))
    assert averaged["n"].item() == 3
    with pytest.raises(ValueError, match="positive"):
        weighted_average([a, b], [1, 0])


def test_the_best_assignment_keeps_the_current_one_unless_another_is_strictly_better():
    """Where the current permutation already takes every row's best score (ties included) it stays, solver or not;
    otherwise the solver's strictly better one replaces it."""
    tied = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    swapped = torch.tensor([1, 0, 2])
    assert best_assignment(tied, swapped) is swapped
    assert best_assignment(tied, torch.arange(3)).tolist() == [0, 1, 2]
    better = torch.tensor([[0.0, 3.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert best_assignment(better, torch.arange(3)).tolist() == [1, 0, 2]
    worse_rows = torch.tensor([[1.0, 0.9, 0.0], [0.0, 1.0, 0.9], [0.9, 0.0, 1.0]])  # current best in every row
    current = torch.arange(3)
    assert best_assignment(worse_rows, current) is current
