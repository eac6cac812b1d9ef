"""BBP-MAP's properties over a model (alignfl/core/merging/bbp_model.py), FedMA's: identical clients give the model back
without growth, a random permutation is recovered exactly, disjoint clients grow a layer up to its cap, a grown model
computes the matched average, and bad inputs are refused."""

from __future__ import annotations

import pytest
import torch

from alignfl.core.merging.bbp import BBPSettings, match_units
from alignfl.core.merging.bbp_model import bbp_matched_average, match_group, output_keys
from alignfl.models import permute_state, random_permutations
from tests.bbp_models import CLASSES, MODELS, SHAPE, STD, cnn, disjoint_state, head, mlp, random_state


@pytest.mark.parametrize("name", list(MODELS))
def test_identical_clients_give_the_model_without_growth(name):
    model = MODELS[name]()
    spec, state = model.permutation_spec(), random_state(model, seed=3)
    sizes = spec.group_sizes(state)
    result = bbp_matched_average([state] * 3, [1.0, 2.0, 3.0], spec, BBPSettings(estimate="weighted"), head=head(model))
    assert result.widths == sizes
    for group, assignments in result.assignments.items():
        assert all(torch.equal(a, torch.arange(sizes[group])) for a in assignments)
    for key, value in state.items():
        assert torch.equal(result.state[key], value), key


def test_posterior_mean_shrinks_identical_clients_towards_the_prior():
    """With the defaults (mu0 = 0, sigma = sigma0 = 1) K identical clients give K/(K+1) of each matched entry."""
    model = MODELS["mlp"]()
    spec, state = model.permutation_spec(), random_state(model, seed=3)
    result = bbp_matched_average([state] * 3, [1.0] * 3, spec, head=head(model))
    outputs = output_keys(spec, state)
    for key, value in state.items():
        expected = value if key in outputs else 0.75 * value
        torch.testing.assert_close(result.state[key], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("estimate", ["posterior", "weighted"])
@pytest.mark.parametrize("name", list(MODELS))
def test_random_permutation_is_recovered_exactly(name, estimate):
    model = MODELS[name]()
    spec, state = model.permutation_spec(), random_state(model, seed=4)
    perms = random_permutations(spec, state, torch.Generator().manual_seed(7))
    permuted = permute_state(spec, state, perms)
    result = bbp_matched_average([state, permuted], [1.0, 1.0], spec, BBPSettings(estimate=estimate), head=head(model))
    assert result.widths == spec.group_sizes(state)
    for group, perm in perms.items():
        assert torch.equal(result.assignments[group][0], torch.arange(perm.numel()))
        assert torch.equal(result.assignments[group][1], perm), group
    if estimate == "weighted":
        for key, value in state.items():
            torch.testing.assert_close(result.state[key], value, rtol=0, atol=1e-6)


def test_disjoint_clients_grow_the_layer_up_to_the_cap():
    """Client k's units live on coordinates 4k..4k+3 only: no two clients share a unit, so every unit opens
    an atom until the cap, after which the last client's units have to join existing atoms."""
    rows = []
    for k in range(3):
        units = torch.zeros(4, 12)
        units[:, 4 * k : 4 * k + 4] = STD * torch.randn(4, 4, generator=torch.Generator().manual_seed(k))
        rows.append(units)
    assert match_units(rows, [1.0] * 3, BBPSettings()).width == 12
    capped = match_units(rows, [1.0] * 3, BBPSettings(max_width=9))
    assert capped.width == 9
    assert all(sorted(a.tolist()) == sorted(set(a.tolist())) for a in capped.assignments)  # one unit per atom each
    assert match_units(rows, [1.0] * 3, BBPSettings(max_width=3)).width == 4  # never narrower than a client


def _grown(name: str, widths: dict[str, int]) -> torch.nn.Module:
    if name == "mlp":
        return mlp((widths["hidden.0"], widths["hidden.1"]))
    return cnn((widths["convs.0"], widths["convs.1"]), widths["fcs.0"])


@pytest.mark.parametrize("per_class", [False, True])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_grown_model_computes_the_matched_average(name, per_class):
    """Clients with disjoint units: every layer grows to the sum of the clients' widths and the grown model
    computes the clients' outputs averaged with their weights (per class with class counts)."""
    clients = [MODELS[name]() for _ in range(3)]
    states = [disjoint_state(client, k, parts=3) for k, client in enumerate(clients)]
    for client, state in zip(clients, states):
        client.load_state_dict(state)
    spec, weights = clients[0].permutation_spec(), [1.0, 2.0, 5.0]
    counts = torch.tensor([[5.0, 0.0, 1.0], [1.0, 4.0, 1.0], [0.0, 0.0, 2.0]]) if per_class else None
    result = bbp_matched_average(
        states, weights, spec, BBPSettings(estimate="weighted"), class_counts=counts, head=head(clients[0])
    )
    assert result.widths == {group: 3 * size for group, size in spec.group_sizes(states[0]).items()}
    grown = _grown(name, result.widths)
    grown.load_state_dict(result.state)
    share = counts / counts.sum(0) if per_class else torch.tensor(weights)[:, None].expand(3, CLASSES) / 8.0
    x = torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = sum(s * client(x) for s, client in zip(share, clients))
        torch.testing.assert_close(grown(x), expected, rtol=1e-4, atol=1e-3)


def test_match_group_uses_aligned_entries_only():
    """A group's vector is its incoming weights and bias; the last hidden group's adds the classifier's columns
    only with ``include_classifier`` (FedMA leaves them out)."""
    model = mlp((5, 4))
    spec, state = model.permutation_spec(), random_state(model, seed=0)
    first = match_group(
        [state, state], [1.0, 1.0], spec, "hidden.0", (), BBPSettings(estimate="weighted"), head=head(model)
    )
    assert [ref.key for ref in first.refs] == ["hidden.0.weight", "hidden.0.bias"]
    assert first.features == (36, 1)
    last = match_group([state, state], [1.0, 1.0], spec, "hidden.1", ("hidden.0",), BBPSettings(), head=head(model))
    assert [ref.key for ref in last.refs] == ["hidden.1.weight", "hidden.1.bias"]
    assert last.features == (5, 1)
    with_classifier = match_group(
        [state, state],
        [1.0, 1.0],
        spec,
        "hidden.1",
        ("hidden.0",),
        BBPSettings(include_classifier=True),
        head=head(model),
    )
    assert [ref.key for ref in with_classifier.refs] == ["hidden.1.weight", "hidden.1.bias", "classifier.weight"]
    assert with_classifier.features == (5, 1, CLASSES)
    with pytest.raises(ValueError, match="hidden.0"):
        match_group([state], [1.0], spec, "hidden.1", ("hidden.9",), BBPSettings(), head=head(model))


def test_bad_inputs_are_refused():
    model = mlp((5, 4))
    spec, state = model.permutation_spec(), random_state(model, seed=0)
    with pytest.raises(ValueError, match="weight"):
        bbp_matched_average([state, state], [1.0], spec, head=head(model))
    with pytest.raises(ValueError, match="weights"):
        bbp_matched_average([state, state], [1.0, 0.0], spec, head=head(model))
    with pytest.raises(ValueError, match="class_counts"):
        bbp_matched_average([state, state], [1.0, 1.0], spec, class_counts=torch.ones(3, CLASSES), head=head(model))
    with pytest.raises(ValueError, match="classes"):
        bbp_matched_average([state, state], [1.0, 1.0], spec, class_counts=torch.ones(2, 7), head=head(model))
    wider = random_state(mlp((6, 4)), seed=0)
    with pytest.raises(ValueError, match="shapes"):
        bbp_matched_average([state, wider], [1.0, 1.0], spec, head=head(model))
