"""Universe (C2M3) matching: many models matched jointly, cycle-consistent by construction, and where it is used
(``matched-reference=universe``, ``fedma-reference=universe``, ``merge --reference universe``)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from alignfl.core.merging.alignment import find_permutations, weighted_average
from alignfl.core.merging.relaxed import best_step, dense, line_polynomial
from alignfl.core.merging.universe import (
    UniverseSettings,
    _gradients,
    _objective,
    _Problem,
    cycle_consistency_error,
    universe_matching,
    universe_merge,
)
from alignfl.core.model_io import federated_state
from alignfl.core.rounds.strategy import Reply
from alignfl.fl_app.analysis.__main__ import main
from alignfl.fl_app.config import ConfigError, build_context, parse_run_config
from alignfl.fl_app.inprocess import run_in_process
from alignfl.models import build_model, invert_permutations, list_models, permute_state, random_permutations
from alignfl.models.registry import model_options
from alignfl.strategies import get_strategy
from alignfl.strategies.fedma import CLASS_COUNTS

SHAPE = (1, 8, 8)
NARROW = {"width_factor": 0.25}
"""Models that take a width factor are matched at a quarter width: the suite stays fast, the groups stay many."""


def _state(name: str, seed: int = 1) -> tuple:
    """A model's spec and state with distinct per-channel normalisation entries (defaults are equal for every
    channel, so a wrongly permuted one would go unnoticed)."""
    torch.manual_seed(seed)
    options = NARROW if "width_factor" in {f.name for f in dataclasses.fields(model_options(name))} else {}
    model = build_model(name, SHAPE, 3, **options)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.2)
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0.0, 0.2)
                module.running_var.uniform_(0.5, 2.0)
    return model.permutation_spec(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _copies(spec, state, count: int) -> tuple[list[dict], list[dict]]:
    """``state`` and ``count - 1`` copies with every group's units randomly permuted, and the permutations."""
    applied = [{g: torch.arange(n) for g, n in spec.group_sizes(state).items()}]
    applied += [random_permutations(spec, state, torch.Generator().manual_seed(seed)) for seed in range(2, count + 1)]
    return [permute_state(spec, state, perms) for perms in applied], applied


def _equal(actual: dict, expected: dict, exact: bool = True) -> bool:
    if actual.keys() != expected.keys():
        return False
    if exact:
        return all(torch.equal(actual[k], expected[k]) for k in expected)
    return all(torch.allclose(actual[k], expected[k], rtol=1e-5, atol=1e-6) for k in expected)


def _brute_objective(spec, states, permutations) -> float:
    """Sum over pairs of models of the inner products of every spec entry, after applying the permutations."""
    carried = [permute_state(spec, state, perms) for state, perms in zip(states, permutations)]
    keys = spec.axes_by_key()
    return sum(
        float((a[key].double() * b[key].double()).sum()) for a, b in itertools.combinations(carried, 2) for key in keys
    )


# --- the engine -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list_models())
def test_permuted_copies_are_matched_into_one_universe_exactly(name):
    """Every model family with a permutation description: 3 to 5 permuted copies of one model are carried back
    into the first one's order exactly, the merge is the model, and reference-based matching is cycle-consistent
    on them too (error 0)."""
    spec, state = _state(name)
    count = 3 + list_models().index(name) % 3
    copies, applied = _copies(spec, state, count)
    assert any(not torch.equal(copies[1][k], state[k]) for k in state)

    merged, match = universe_merge(copies, [1.0 + i for i in range(count)], spec)
    for perms, used in zip(match.permutations, applied):
        expected = invert_permutations(used)
        assert perms.keys() == expected.keys()
        wrong = [g for g in expected if not torch.equal(perms[g], expected[g])]
        assert not wrong, f"groups {wrong} not recovered"
    assert _equal(merged, state, exact=False)
    # the maps between any two copies compose through the universe: i -> j is P_j^T P_i
    for i, j in itertools.combinations(range(count), 2):
        back = invert_permutations(match.permutations[j])
        i_to_j = {g: match.permutations[i][g][back[g]] for g in back}  # model j's unit order, from model i
        assert _equal(permute_state(spec, copies[i], i_to_j), copies[j])
    assert set(cycle_consistency_error(state, copies, spec).values()) == {0.0}
    assert match.objective == [match.projected]  # the pairwise start is already the joint optimum


@pytest.mark.parametrize("name", ["small-mlp", "twocnn", "resnet20", "transformer-1", "vgg9-bn"])
def test_two_models_match_as_pairwise_weight_matching(name):
    """N = 2 unrelated models: the universe map from model 1 to model 0 is alignfl.core.merging.alignment's weight
    matching."""
    spec, first = _state(name, seed=1)
    _, second = _state(name, seed=2)
    match = universe_matching([first, second], spec, generator=torch.Generator().manual_seed(5))
    pairwise = find_permutations(first, second, spec, "weight", torch.Generator().manual_seed(5))
    assert all(torch.equal(match.permutations[0][g], torch.arange(len(p))) for g, p in pairwise.items())
    assert all(torch.equal(match.permutations[1][g], pairwise[g]) for g in pairwise)


@pytest.mark.parametrize("start", ["pairwise", "identity"])
def test_the_objective_never_decreases_and_scores_the_returned_permutations(start):
    spec, _ = _state("small-mlp")
    states = [_state("small-mlp", seed)[1] for seed in range(1, 5)]  # unrelated models: Frank-Wolfe has work
    match = universe_matching(states, spec, UniverseSettings(iterations=30, tolerance=1e-9), start=start)
    assert len(match.objective) > 2
    assert all(later >= earlier for earlier, later in zip(match.objective, match.objective[1:]))
    assert match.projected == pytest.approx(_brute_objective(spec, states, match.permutations), rel=1e-9)
    assert match.projected >= match.objective[0]  # never below the start
    assert all(torch.equal(p, torch.arange(len(p))) for p in match.permutations[0].values())  # model 0's order


def test_more_iterations_never_score_lower_and_the_cap_is_kept():
    spec, _ = _state("small-mlp")
    states = [_state("small-mlp", seed)[1] for seed in range(1, 5)]
    short = universe_matching(states, spec, UniverseSettings(iterations=2, tolerance=1e-12), start="identity")
    longer = universe_matching(states, spec, UniverseSettings(iterations=20, tolerance=1e-12), start="identity")
    assert len(short.objective) <= 3
    assert longer.objective[: len(short.objective)] == short.objective
    assert longer.objective[-1] >= short.objective[-1]


def test_the_line_search_polynomial_is_the_objective_along_the_segment():
    """Frank-Wolfe's exact line search: the objective at ``X + t (S - X)`` is the polynomial, for relaxed ``X``;
    and the gradient is the objective's derivative."""
    spec, _ = _state("twocnn")
    states = [_state("twocnn", seed)[1] for seed in range(1, 4)]
    problem = _Problem(spec, states[0], None, ())
    wide = [{e.key: s[e.key].double() for e in problem.entries} for s in states]
    generator = torch.Generator().manual_seed(0)
    sizes = spec.group_sizes(states[0])

    def doubly_stochastic(n: int) -> torch.Tensor:
        matrix = torch.rand(n, n, generator=generator, dtype=torch.float64)
        for _ in range(300):
            matrix = matrix / matrix.sum(1, keepdim=True)
            matrix = matrix / matrix.sum(0, keepdim=True)
        return matrix

    plans = [{g: doubly_stochastic(n) for g, n in sizes.items()} for _ in states]
    vertices = [{g: torch.randperm(n, generator=generator) for g, n in sizes.items()} for _ in states]
    value, gradients, images = _gradients(problem, wide, plans)
    polynomial = line_polynomial(problem.entries, wide, plans, vertices, images)
    for t in (0.0, 0.25, 0.6, 1.0):
        mixed = [{g: (1 - t) * p[g] + t * dense(v[g]) for g in p} for p, v in zip(plans, vertices)]
        assert np.polyval(polynomial[::-1], t) == pytest.approx(_objective(problem, wide, mixed), rel=1e-9)
    assert polynomial[0] == pytest.approx(value, rel=1e-12)
    step, gain = best_step(polynomial)
    assert 0.0 <= step <= 1.0 and gain >= 0.0
    direction = torch.randn(sizes["convs.1"], sizes["convs.1"], generator=generator, dtype=torch.float64)
    nudged = [dict(plan) for plan in plans]
    nudged[1]["convs.1"] = plans[1]["convs.1"] + 1e-6 * direction
    slope = (_objective(problem, wide, nudged) - value) / 1e-6
    assert slope == pytest.approx(float((gradients[1]["convs.1"] * direction).sum()), rel=1e-4)


def test_reference_based_matching_of_unrelated_models_is_not_cycle_consistent():
    """The diagnostic: aligning onto a reference composes maps that direct pairwise matching does not find; the
    universe's maps compose by construction."""
    spec, reference = _state("small-mlp", seed=9)
    states = [_state("small-mlp", seed)[1] for seed in range(1, 5)]
    errors = cycle_consistency_error(reference, states, spec)
    assert set(errors) == set(spec.groups) and all(0.0 <= e <= 1.0 for e in errors.values())
    assert sum(errors.values()) > 0
    assert cycle_consistency_error(reference, states[:1], spec) == {}
    few = cycle_consistency_error(reference, states, spec, max_pairs=2, generator=torch.Generator().manual_seed(1))
    assert set(few) == set(errors)


def _full_size_mlp(seed: int) -> dict:
    torch.manual_seed(seed)
    return build_model("small-mlp", (1, 28, 28), 10).state_dict()


def test_two_models_with_one_of_them_the_reference_are_cycle_consistent():
    """With two models and the first as the reference, the composed map is the direct one: the diagnostic is 0
    (it counts disagreements of the maps, not of coordinate descent's visiting orders)."""
    first, second = (_full_size_mlp(seed) for seed in (0, 1))  # narrow ones rarely reach two local optima
    spec = build_model("small-mlp", (1, 28, 28), 10).permutation_spec()
    for seed in range(3):
        errors = cycle_consistency_error(first, [first, second], spec, generator=torch.Generator().manual_seed(seed))
        assert set(errors) == set(spec.groups) and all(error == 0.0 for error in errors.values()), errors


def test_one_group_is_matched_with_the_earlier_ones_fixed():
    """FedMA's stages: only the free group's entries (and those of fixed groups) take part."""
    spec, state = _state("small-mlp")
    copies, applied = _copies(spec, state, 3)
    groups = list(spec.groups)
    # the first two groups already in the original order in every copy
    copies = [
        permute_state(spec, c, {g: invert_permutations(a)[g] for g in groups[:2]}) for c, a in zip(copies, applied)
    ]
    match = universe_matching(copies, spec, groups=[groups[2]], fixed=groups[:2])
    for perms, used in zip(match.permutations, applied):
        assert list(perms) == [groups[2]]
        assert torch.equal(perms[groups[2]], invert_permutations(used)[groups[2]])


def test_bad_arguments_are_refused_by_name():
    spec, state = _state("small-mlp")
    with pytest.raises(ValueError, match=r"UniverseSettings.iterations = 0 is not allowed: must be an integer >= 1"):
        UniverseSettings(iterations=0)
    with pytest.raises(ValueError, match=r"UniverseSettings.tolerance = -1.0 is not allowed: must be a finite number"):
        UniverseSettings(tolerance=-1.0)
    with pytest.raises(ValueError, match=r"unknown universe start 'random'"):
        universe_matching([state, state], spec, start="random")
    with pytest.raises(ValueError, match=r"unknown permutation groups \['nope'\]"):
        universe_matching([state, state], spec, groups=["nope"])
    with pytest.raises(ValueError, match=r"'hidden.1.bias' has shape \(7,\)"):
        universe_matching([state, dict(state, **{"hidden.1.bias": torch.zeros(7)})], spec)


# --- the run-config keys, the strategies and the merge tool ---------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "key", "fragment"),
    [
        ({"strategy": "matched", "matched-universe-iterations": 0}, "matched-universe-iterations", ">= 1"),
        ({"strategy": "matched", "matched-universe-iterations": -3}, "matched-universe-iterations", ">= 1"),
        ({"strategy": "matched", "matched-universe-tolerance": 0.0}, "matched-universe-tolerance", "> 0"),
        ({"strategy": "matched", "matched-universe-tolerance": -1e-3}, "matched-universe-tolerance", "> 0"),
        ({"strategy": "matched", "matched-reference": "everyone"}, "matched-reference", "'universe'"),
        (
            {"strategy": "matched", "matched-reference": "universe", "matched-cost": "l1"},
            "matched-reference",
            "needs matched-cost='weight'",
        ),
        ({"strategy": "fedma", "fedma-universe-iterations": 0}, "fedma-universe-iterations", ">= 1"),
        ({"strategy": "fedma", "fedma-reference": "universe"}, "fedma-reference", "needs fedma-matching='weight'"),
    ],
)
def test_bad_universe_keys_are_refused_with_what_is_allowed(values, key, fragment):
    with pytest.raises(ConfigError) as error:
        parse_run_config({"model": "small-mlp", "dataset": "digits", **values})
    assert f"'{key}'" in str(error.value) and fragment in str(error.value)


@pytest.mark.parametrize(
    ("strategy", "keys"),
    [
        ("matched", {"matched-reference": "universe"}),
        ("fedma", {"fedma-reference": "universe", "fedma-matching": "weight"}),
    ],
)
def test_the_universe_needs_a_permutation_description(strategy, keys):
    config = parse_run_config({"model": "small-mlp", "dataset": "digits", "strategy": strategy, **keys})
    torch.manual_seed(0)
    context = build_context(config, build_model("small-mlp", SHAPE, 10))
    reference = next(key for key in keys if key.endswith("-reference"))
    with pytest.raises(ConfigError, match=rf"'{reference}' = 'universe' is not allowed.*no(ne| permutation)"):
        get_strategy(strategy).server(dataclasses.replace(context, spec=None))


def _reply(state: dict, node: int, examples: int = 10, counts: torch.Tensor | None = None) -> Reply:
    records = {"arrays": ArrayRecord({k: v.clone() for k, v in state.items()})}
    if counts is not None:
        records[CLASS_COUNTS] = ArrayRecord({"counts": counts})
    content = RecordDict({**records, "metrics": MetricRecord({"num-examples": examples})})
    return Reply(node, node, content, examples)


def test_matched_universe_merges_permuted_clients_back_and_records_its_diagnostics():
    torch.manual_seed(0)
    model = build_model("small-mlp", SHAPE, 10)
    spec, state = model.permutation_spec(), federated_state(model)
    copies, _ = _copies(spec, state, 3)
    run = parse_run_config(
        {"model": "small-mlp", "dataset": "digits", "strategy": "matched", "matched-reference": "universe"}
    )
    strategy = get_strategy("matched").server(build_context(run, model))
    torch.manual_seed(4)  # a global model unrelated to the clients: the unit order is the first client's
    other = federated_state(build_model("small-mlp", SHAPE, 10))
    merge = strategy.aggregate(1, [_reply(c, node) for node, c in enumerate(copies)], ArrayRecord(other))
    assert _equal(merge.arrays.to_torch_state_dict(), state, exact=False)
    metrics = merge.metrics
    assert metrics["universe-objective"] and set(metrics["cycle-consistency-error"]) == set(spec.groups)
    assert set(metrics["units-moved"]) == set(spec.groups)


def test_a_fedma_cycle_matches_permuted_clients_into_one_universe_layer_by_layer():
    torch.manual_seed(0)
    model = build_model("small-mlp", SHAPE, 10)
    spec, state = model.permutation_spec(), federated_state(model)
    copies, _ = _copies(spec, state, 3)
    config = {"fedma-matching": "weight", "fedma-reference": "universe"}
    run = parse_run_config({"strategy": "fedma", "model": "small-mlp", "dataset": "digits", **config})
    strategy = get_strategy("fedma").server(build_context(run, model))
    counts = torch.ones(10, dtype=torch.long)
    merge = strategy.aggregate(1, [_reply(c, node, counts=counts) for node, c in enumerate(copies)], ArrayRecord(state))
    assert merge.metrics["cycle-consistency-error"] == {"hidden.0": 0.0}
    resumed = get_strategy("fedma").server(build_context(run, model))  # the carried reference is checkpointed
    resumed.load_state_dict(strategy.state_dict())
    assert _equal(resumed.universe_reference, strategy.universe_reference)
    for stage in range(1, 5):  # clients that do not train send back the models they are sent
        assert strategy.stage == stage
        assert merge.metrics["universe-objective"]
        replies = [_reply(m, node, counts=counts) for node, m in strategy.client_models.items()]
        merge = strategy.aggregate(stage + 1, replies, merge.arrays)
    assert strategy.stage == 0
    assert _equal(merge.arrays.to_torch_state_dict(), state, exact=False)
    assert "universe-reference" in strategy.state_dict()


def test_a_federated_matched_universe_run_completes_and_records_the_objective(tmp_path):
    config = {
        "strategy": "matched",
        "matched-reference": "universe",
        "dataset": "digits",
        "model": "small-mlp",
        "num-server-rounds": 2,
        "local-epochs": 1,
        "results-dir": str(tmp_path),
        "device": "cpu",
    }
    run_in_process(config, num_nodes=3)
    (folder,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        objective = row["universe-objective"]
        assert objective and all(later >= earlier for earlier, later in zip(objective, objective[1:]))
        assert set(row["cycle-consistency-error"]) == {"hidden.0", "hidden.1", "hidden.2", "hidden.3"}
    assert rows[-1]["clients-trained"] == 3


def test_the_merge_tool_matches_into_a_universe(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["merge", "--clients", "3", "--epochs", "1", "--reference", "universe", "--out", str(out)]
    assert main([*argv, "--universe-iterations", "5"]) == 0
    payload = json.loads((out / "merge.json").read_text())
    assert payload["reference"] == "universe" and payload["universe"] == {"iterations": 5, "tolerance": 1e-6}
    assert set(payload["merged-accuracy"]) == {"average", "matched-universe", "matched-bbp", "ensemble"}
    assert 1 <= len(payload["universe-objective"]) <= 6
    assert set(payload["cycle-consistency-error"]) == {"hidden.0", "hidden.1", "hidden.2", "hidden.3"}
    assert "matched-universe" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--reference", "universe", "--costs", "l1"], "--costs 'l1' is not allowed with --reference universe"),
        (["--reference", "universe", "--costs", "ot"], "--costs 'ot' is not allowed with --reference universe"),
        (["--reference", "everyone"], "--reference must be a client index in [0, 2) or universe, got everyone"),
        (["--universe-iterations", "0"], "--universe-iterations 0 is not allowed: must be an integer >= 1"),
        (["--universe-tolerance", "0"], "--universe-tolerance 0.0 is not allowed: must be a finite number > 0"),
    ],
)
def test_bad_merge_options_stop_before_training(argv, fragment, tmp_path, capsys):
    assert main(["merge", *argv, "--out", str(tmp_path / "out")]) == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_merging_the_same_models_in_a_universe_or_onto_a_reference_agree_on_copies():
    spec, state = _state("transformer-1")
    copies, _ = _copies(spec, state, 4)
    merged, _ = universe_merge(copies, [1.0, 1.0, 2.0, 4.0], spec)
    assert _equal(merged, weighted_average([state] * 4, [1.0, 1.0, 2.0, 4.0]), exact=False)
