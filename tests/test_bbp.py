"""BBP-MAP (alignfl/core/merging/bbp.py; over a model, alignfl/core/merging/bbp_model.py): the vectorised matching
equals a plain loop-based one, and it has FedMA's properties.

The reference below writes the paper's cost (PFNM / FedMA, as in the authors'
``matching/pfnm.py``) element by element with Python floats and keeps each
atom as a list of its members, recomputing its sums for every cost; it follows
the same procedure (widest client first, sweeps in the order drawn from the
same generator, atoms numbered by first appearance, stop when a sweep changes
nothing), so both must agree exactly on assignments and closely on weights.

Weights are drawn with a standard deviation of 2, so a unit's squared norm is
well above the default sigma = 1: with smaller weights the popularity terms
dominate and BBP-MAP opens new atoms even for identical units, as the authors'
code does. Two hand-worked examples pin that second scale (weights of about
0.1), at the default sigma and at a sigma of their own scale.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from alignfl.core.merging.bbp import BBPSettings, extended_cost, match_units
from alignfl.core.merging.bbp_model import bbp_matched_average
from alignfl.models import permute_state, random_permutations
from tests.bbp_models import CLASSES, head, mlp, prototype_rows, random_state

# --- the plain reference ---------------------------------------------------------------------


def reference_cost(
    unit_rows: list[list[float]],
    atoms: list[tuple[list[float], int]],
    clients: int,
    settings: BBPSettings,
    new_columns: int,
) -> list[list[float]]:
    """The extended cost, one element at a time: existing atoms (natural sum, count), then new atoms."""
    obs, prior = 1.0 / settings.sigma, 1.0 / settings.sigma0
    prior_mean = settings.mu0 * prior
    cost = []
    for unit in unit_rows:
        row = []
        for natural, count in atoms:
            precision = prior + count * obs
            value = 0.0
            for x, n in zip(unit, natural):
                value += (x * obs + n) ** 2 / (precision + obs) - n**2 / precision
            popular = min(count, 10)
            row.append(value + math.log(popular / (clients - popular)))
        fresh = sum((x * obs + prior_mean) ** 2 / (prior + obs) - prior_mean**2 / prior for x in unit)
        for t in range(1, new_columns + 1):
            row.append(fresh - 2.0 * math.log(t) + 2.0 * math.log(settings.gamma / clients))
        cost.append(row)
    return cost


def reference_bbp(
    rows: list[list[list[float]]], weights: list[float], settings: BBPSettings, generator: torch.Generator
) -> tuple[list[list[int]], list[list[float]]]:
    """BBP-MAP with atoms as member lists ``[(client, unit), ...]``: assignments and global unit vectors."""
    clients, dims = len(rows), len(rows[0][0])
    obs, prior = 1.0 / settings.sigma, 1.0 / settings.sigma0
    atoms: list[list[tuple[int, int]]] = []
    assign: list[list[int]] = [[] for _ in rows]

    def natural(members: list[tuple[int, int]]) -> list[float]:
        return [settings.mu0 * prior + obs * sum(rows[k][l][d] for k, l in members) for d in range(dims)]

    def relabel(order: list[int]) -> None:
        new_id = {old: new for new, old in enumerate(order)}
        atoms[:] = [atoms[i] for i in order]
        for k in range(clients):
            assign[k] = [new_id[i] for i in assign[k]]

    def add(k: int) -> None:
        width = len(atoms)
        if width == 0:
            columns = list(range(len(rows[k])))
        else:
            new_columns = min(len(rows[k]), settings.max_width - width)
            cost = reference_cost(rows[k], [(natural(m), len(m)) for m in atoms], clients, settings, new_columns)
            columns = list(linear_sum_assignment(np.array(cost), maximize=True)[1])
        chosen = []
        for column in columns:
            if column >= width:
                atoms.append([])
                column = len(atoms) - 1
            chosen.append(column)
        for l, i in enumerate(chosen):
            atoms[i].append((k, l))
        assign[k] = chosen

    def remove(k: int) -> None:
        for l, i in enumerate(assign[k]):
            atoms[i].remove((k, l))
        assign[k] = []
        relabel([i for i, members in enumerate(atoms) if members])

    def renumber() -> None:
        order: list[int] = []
        for k in range(clients):
            order += [i for i in assign[k] if i not in order]
        relabel(order)

    for k in sorted(range(clients), key=lambda k: -len(rows[k])):
        add(k)
    renumber()
    for _ in range(settings.iterations if clients > 1 else 0):
        before = [list(a) for a in assign]
        for k in torch.randperm(clients, generator=generator).tolist():
            remove(k)
            add(k)
        renumber()
        if before == assign:
            break
    units = []
    for members in atoms:
        if settings.estimate == "posterior":
            units.append([n / (prior + len(members) * obs) for n in natural(members)])
        else:
            total = sum(weights[k] for k, _ in members)
            units.append([sum(weights[k] * rows[k][l][d] for k, l in members) / total for d in range(dims)])
    return assign, units


# --- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("sigma", 0.0),
        ("sigma", float("inf")),
        ("sigma0", -1.0),
        ("gamma", 0.0),
        ("mu0", float("nan")),
        ("max_width", 0),
        ("max_width", 2.5),
        ("iterations", -1),
        ("iterations", True),
        ("estimate", "mean"),
        ("include_classifier", 1),
        ("include_classifier", "yes"),
        ("sigma", "1"),
    ],
)
def test_settings_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        BBPSettings(**{field: value})


def test_defaults_are_the_authors():
    settings = BBPSettings()
    assert (settings.sigma, settings.sigma0, settings.mu0, settings.gamma) == (1.0, 1.0, 0.0, 7.0)
    assert (settings.max_width, settings.iterations, settings.estimate) == (700, 5, "posterior")
    assert settings.include_classifier is False  # FedMA matches the last hidden layer without the classifier


# --- the vectorised cost and matching equal the loop-based reference ------------------------------


def test_cost_matches_loop_reference():
    generator = torch.Generator().manual_seed(0)
    settings = BBPSettings(sigma=0.5, sigma0=2.0, mu0=0.3, gamma=5.0)
    rows = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    natural = torch.randn(7, 6, generator=generator, dtype=torch.float64)
    counts = torch.tensor([1.0, 2.0, 5.0, 9.0, 10.0, 11.0, 3.0], dtype=torch.float64)
    cost = extended_cost(rows, natural, counts, 12, settings, 3)
    expected = reference_cost(rows.tolist(), list(zip(natural.tolist(), [int(c) for c in counts])), 12, settings, 3)
    torch.testing.assert_close(cost, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize(
    "settings",
    [
        BBPSettings(),
        BBPSettings(estimate="weighted"),
        BBPSettings(sigma=2.0, sigma0=0.5, mu0=0.2, gamma=3.0),
        BBPSettings(max_width=7, iterations=2),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matching_matches_loop_reference(settings, seed):
    rows = prototype_rows(4, [5, 4, 5, 5], 4, pool=7, seed=seed)
    weights = [1.0, 2.0, 0.5, 1.5]
    match = match_units(rows, weights, settings, torch.Generator().manual_seed(seed))
    assign, units = reference_bbp([r.tolist() for r in rows], weights, settings, torch.Generator().manual_seed(seed))
    assert [a.tolist() for a in match.assignments] == assign
    assert match.width == len(units) <= settings.max_width
    torch.testing.assert_close(match.units, torch.tensor(units, dtype=torch.float64), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("include_classifier", [False, True])
def test_model_matches_loop_reference(include_classifier):
    """A whole MLP: each layer's rows, the scattering of inputs and the averaged classifier, by hand; the last
    hidden layer's rows hold the classifier's columns only with ``include_classifier``."""
    model = mlp((5, 4))
    spec = model.permutation_spec()
    prototypes = random_state(model, seed=0)
    generator = torch.Generator().manual_seed(1)
    states = []
    for _ in range(3):  # shared prototypes with noise, each client with its own permutations
        noisy = {k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in prototypes.items()}
        states.append(permute_state(spec, noisy, random_permutations(spec, noisy, generator)))
    weights = [1.0, 3.0, 2.0]
    settings = BBPSettings(estimate="weighted", include_classifier=include_classifier)
    result = bbp_matched_average(states, weights, spec, settings, torch.Generator().manual_seed(5), head=head(model))

    order = torch.Generator().manual_seed(5)
    first = [torch.cat([s["hidden.0.weight"], s["hidden.0.bias"][:, None]], 1).double().tolist() for s in states]
    assign0, units0 = reference_bbp(first, weights, settings, order)
    width0 = len(units0)
    scattered = []
    for state, assignment in zip(states, assign0):
        grown = [[0.0] * width0 for _ in range(4)]
        for j, i in enumerate(assignment):
            for r in range(4):
                grown[r][i] = float(state["hidden.1.weight"][r, j])
        scattered.append(grown)
    second = [
        [
            grown[r]
            + [float(s["hidden.1.bias"][r])]
            + (s["classifier.weight"][:, r].double().tolist() if include_classifier else [])
            for r in range(4)
        ]
        for grown, s in zip(scattered, states)
    ]
    assign1, units1 = reference_bbp(second, weights, settings, order)
    width1 = len(units1)
    total = sum(weights)
    classifier = [
        [
            sum(
                w * float(s["classifier.weight"][c, j])
                for s, a, w in zip(states, assign1, weights)
                for j in range(4)
                if a[j] == i
            )
            / total
            for i in range(width1)
        ]
        for c in range(CLASSES)
    ]

    assert result.widths == {"hidden.0": width0, "hidden.1": width1}
    assert [a.tolist() for a in result.assignments["hidden.0"]] == assign0
    assert [a.tolist() for a in result.assignments["hidden.1"]] == assign1
    expected = {
        "hidden.0.weight": [u[:36] for u in units0],
        "hidden.0.bias": [u[36] for u in units0],
        "hidden.1.weight": [u[:width0] for u in units1],
        "hidden.1.bias": [u[width0] for u in units1],
        "classifier.weight": classifier,
        "classifier.bias": [
            sum(w * float(s["classifier.bias"][c]) for s, w in zip(states, weights)) / total for c in range(CLASSES)
        ],
    }
    for key, value in expected.items():
        torch.testing.assert_close(result.state[key], torch.tensor(value, dtype=torch.float32), rtol=1e-5, atol=1e-5)
