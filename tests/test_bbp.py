"""BBP-MAP (core/bbp.py; over a model, core/bbp_model.py): the vectorised matching equals a plain loop-based
one, and it has FedMA's properties.

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
from torch import Tensor

from core.bbp import BBPSettings, extended_cost, match_units
from core.bbp_model import bbp_matched_average, match_group, output_keys
from models import PanSettings, permute_state, random_permutations
from models.cnn import POOL, PlainConvNet
from models.mlp import MLP
from models.protocol import head_of

SHAPE = (1, 6, 6)
CLASSES = 3
STD = 2.0


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


# --- data ----------------------------------------------------------------------------------


def prototype_rows(clients: int, widths: list[int], dims: int, pool: int, seed: int) -> list[Tensor]:
    """Each client's units: a random choice of ``pool`` shared prototypes, plus noise, in random order."""
    generator = torch.Generator().manual_seed(seed)
    prototypes = STD * torch.randn(pool, dims, generator=generator, dtype=torch.float64)
    return [
        prototypes[torch.randperm(pool, generator=generator)[:width]]
        + 0.3 * torch.randn(width, dims, generator=generator, dtype=torch.float64)
        for width in widths[:clients]
    ]


def random_state(model: torch.nn.Module, seed: int) -> dict[str, Tensor]:
    """The model's state with every floating entry redrawn as N(0, STD^2), so every unit is distinct."""
    generator = torch.Generator().manual_seed(seed)
    return {
        key: STD * torch.randn(value.shape, generator=generator) if value.is_floating_point() else value.clone()
        for key, value in model.state_dict().items()
    }


def disjoint_state(model: torch.nn.Module, part: int, parts: int) -> dict[str, Tensor]:
    """A random state whose first layer reads only the ``part``-th of ``parts`` slices of each unit's inputs
    (no bias): clients made with different parts have orthogonal first-layer units, and so different units
    in every later layer too (their inputs do not overlap once scattered)."""
    state = random_state(model, seed=10 + part)
    first = next(iter(model.permutation_spec().groups))
    weight = state[f"{first}.weight"].reshape(state[f"{first}.weight"].shape[0], -1)
    mine = torch.arange(weight.shape[1]) * parts // weight.shape[1] == part
    weight[:, ~mine] = 0.0
    state[f"{first}.bias"].zero_()
    return state


def head(model: torch.nn.Module) -> tuple[str, ...]:
    return head_of(model).keys


def mlp(hidden: tuple[int, ...]) -> MLP:
    return MLP(SHAPE, CLASSES, hidden, PanSettings())


def cnn(convs: tuple[int, int], fc: int, norm: str = "none") -> PlainConvNet:
    return PlainConvNet(SHAPE, CLASSES, (convs[0], POOL, convs[1]), (fc,), 3, PanSettings(), norm)


MODELS = {"mlp": lambda: mlp((8, 6)), "cnn": lambda: cnn((4, 5), 6), "cnn-bn": lambda: cnn((4, 5), 6, "bn")}


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


# --- a hand-worked example at a second weight scale -----------------------------------------------
#
# Two clients with two small units each (weights of about 0.1, where the tests above use a standard deviation of
# 2): client 0 has a1 = (0.1, -0.2), a2 = (0.0, 0.1); client 1 has b1 = (0.0, 0.12) ~ a2 and b2 = (0.12, -0.2) ~ a1.
# The scores below are the authors' formulas (module notes of core/bbp.py) worked out with plain numbers:
#   atom i (natural N_i, count c, P = 1/sigma0 + c/sigma):  ||x/sigma + N_i||^2 / (P + 1/sigma) - ||N_i||^2 / P
#                                                           + log(c / (K - c))       (K = 2, c = 1: log 1 = 0)
#   t-th new atom (mu0 = 0):  ||x/sigma||^2 / (1/sigma0 + 1/sigma) + 2 log(gamma / K) - 2 log t

CLIENTS_A = [[0.1, -0.2], [0.0, 0.1]]
CLIENTS_B = [[0.0, 0.12], [0.12, -0.2]]
OPEN = 2 * math.log(7 / 2)  # 2 log(gamma / K) = 2.5055 with gamma = 7, K = 2
SECOND = 2 * math.log(2)  # the second new atom's extra 2 log t = 1.3863


def _assert_hand_worked(
    settings: BBPSettings, cost: list[list[float]], assignments: list[list[int]], units: list[list[float]]
) -> None:
    """Client 1's scores against the atoms client 0 opened (client 0 is as wide and comes first) are ``cost``,
    and BBP-MAP gives ``assignments`` and posterior ``units`` in every sweep order."""
    rows = [torch.tensor(CLIENTS_A, dtype=torch.float64), torch.tensor(CLIENTS_B, dtype=torch.float64)]
    first_pass = extended_cost(rows[1], rows[0] / settings.sigma, torch.ones(2, dtype=torch.float64), 2, settings, 2)
    torch.testing.assert_close(first_pass, torch.tensor(cost, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    for seed in range(4):
        match = match_units(rows, [1.0, 1.0], settings, generator=seed)
        assert [a.tolist() for a in match.assignments] == assignments
        torch.testing.assert_close(match.units, torch.tensor(units, dtype=torch.float64), rtol=0, atol=1e-12)


def test_hand_worked_small_weights_open_new_atoms_at_the_default_scale():
    """sigma = sigma0 = 1: the new-atom bonus 2 log(7/2) = 2.51 dwarfs every match score (about 0.01 for weights
    of 0.1), so every unit opens its own atom, even b1 next to a2 (the authors' code does the same)."""
    expected = [  # rows b1, b2; columns a1, a2, new atom t = 1, t = 2; P = 1 + 1 = 2, P + 1 = 3
        [
            (0.1**2 + 0.08**2) / 3 - (0.1**2 + 0.2**2) / 2,  # b1 + a1 = (0.1, -0.08): -0.0195
            (0.0**2 + 0.22**2) / 3 - (0.0**2 + 0.1**2) / 2,  # b1 + a2 = (0.0, 0.22):  0.0111
            (0.0**2 + 0.12**2) / 2 + OPEN,  # 2.5127
            (0.0**2 + 0.12**2) / 2 + OPEN - SECOND,
        ],  # 1.1264
        [
            (0.22**2 + 0.4**2) / 3 - (0.1**2 + 0.2**2) / 2,  # b2 + a1 = (0.22, -0.4): 0.0445
            (0.12**2 + 0.1**2) / 3 - (0.0**2 + 0.1**2) / 2,  # b2 + a2 = (0.12, -0.1): 0.0031
            (0.12**2 + 0.2**2) / 2 + OPEN,  # 2.5327
            (0.12**2 + 0.2**2) / 2 + OPEN - SECOND,
        ],  # 1.1464
    ]
    # Best assignment: both new atoms, 2.5127 + 1.1464 = 1.1264 + 2.5327 = 3.6592, against at most
    # 2.5327 + 0.0111 = 2.5438 with one match. A sweep takes a client out (its atoms go) and puts it back: the
    # same scores with the clients' roles swapped, so nothing changes.
    # Posterior mean of a one-member atom: (mu0/sigma0 + x/sigma) / (1/sigma0 + 1/sigma) = x / 2.
    _assert_hand_worked(
        BBPSettings(), expected, [[0, 1], [2, 3]], [[0.05, -0.1], [0.0, 0.05], [0.0, 0.06], [0.06, -0.1]]
    )


def test_hand_worked_small_weights_match_at_their_own_scale():
    """sigma = sigma0 = 0.01 (variances of weights of about 0.1): x/sigma is 100 x, so the match scores are in
    the units of the new-atom bonus again; b2 joins a1's atom and b1 still opens its own."""
    expected = [  # rows b1 = (0, 12), b2 = (12, -20) scaled; atoms a1 = (10, -20), a2 = (0, 10); P = 200, P + 100 = 300
        [
            (10**2 + 8**2) / 300 - (10**2 + 20**2) / 200,  # b1 + a1 = (10, -8):   0.5467 - 2.5 = -1.9533
            (0**2 + 22**2) / 300 - (0**2 + 10**2) / 200,  # b1 + a2 = (0, 22):    1.6133 - 0.5 = 1.1133
            (0**2 + 12**2) / 200 + OPEN,  # 0.72 + 2.5055 = 3.2255
            (0**2 + 12**2) / 200 + OPEN - SECOND,
        ],  # 1.8392
        [
            (22**2 + 40**2) / 300 - (10**2 + 20**2) / 200,  # b2 + a1 = (22, -40):  6.9467 - 2.5 = 4.4467
            (12**2 + 10**2) / 300 - (0**2 + 10**2) / 200,  # b2 + a2 = (12, -10):  0.8133 - 0.5 = 0.3133
            (12**2 + 20**2) / 200 + OPEN,  # 2.72 + 2.5055 = 5.2255
            (12**2 + 20**2) / 200 + OPEN - SECOND,
        ],  # 3.8392
    ]
    # Best: b1 new (3.2255) + b2 on a1 (4.4467) = 7.6721; both new 3.2255 + 3.8392 = 7.0647; b1 on a2 and b2 on
    # a1 = 5.5600; b1 on a2 and b2 new = 6.3389. Atoms: {a1, b2}, {a2}, {b1}.
    # Sweep, client 1 out: back to client 0's atoms, and the same scores put it back the same way.
    # Sweep, client 0 out: atoms {b2} (natural (12, -20)) and {b1} ((0, 12)), each one member; client 0 scores
    #   a1 = (10, -20) on {b2}: (22**2 + 40**2) / 300 - (12**2 + 20**2) / 200 = 4.2267,
    #                  on {b1}: (10**2 + 8**2) / 300 - (0**2 + 12**2) / 200 = -0.1733,
    #                  new: (10**2 + 20**2) / 200 + OPEN = 5.0055 (t = 2: 3.6192);
    #   a2 = (0, 10)   on {b2}: (12**2 + 10**2) / 300 - (12**2 + 20**2) / 200 = -1.9067,
    #                  on {b1}: (0**2 + 22**2) / 300 - (0**2 + 12**2) / 200 = 0.8933,
    #                  new: (0**2 + 10**2) / 200 + OPEN = 3.0055 (t = 2: 1.6192);
    #   best: a1 on {b2} and a2 new, 4.2267 + 3.0055 = 7.2322 (both new: 6.6247): the same atoms, so the
    #   sweep changes nothing, in either order, and matching stops.
    # Posterior means, natural / precision: {a1, b2}: (10 + 12, -20 - 20) / (100 + 2 * 100);
    # {a2}: (0, 10) / 200; {b1}: (0, 12) / 200.
    _assert_hand_worked(
        BBPSettings(sigma=0.01, sigma0=0.01),
        expected,
        [[0, 1], [2, 0]],
        [[22 / 300, -40 / 300], [0.0, 10 / 200], [0.0, 12 / 200]],
    )


# --- properties -----------------------------------------------------------------------------------


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
