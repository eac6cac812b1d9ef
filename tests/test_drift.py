"""Drift: units moved from the round's start and between clients, and the references that can move units (a client's
model, an iterative reference that starts from it)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from alignfl.core.merging.drift import MOVED_BETWEEN, MOVED_FROM_START, units_moved, units_moved_row
from alignfl.core.rounds.strategy import Reply, ServerStrategy
from alignfl.fl_app.config import ConfigError, build_context, check_run, parse_run_config
from alignfl.models import build_model, permute_state, random_permutations
from alignfl.strategies import get_strategy
from tests.faulty_grids import scripted_runner


def _mlp() -> tuple:
    torch.manual_seed(0)
    model = build_model("small-mlp", (1, 8, 8), 10)
    return model, model.permutation_spec(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reply(state: dict[str, torch.Tensor], examples: int, node: int) -> Reply:
    content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": examples})})
    return Reply(node, node, content, examples)


def _shares(permutations: dict[str, torch.Tensor]) -> dict[str, float]:
    return {g: (p != torch.arange(len(p))).double().mean().item() for g, p in permutations.items()}


def test_units_moved_is_the_share_of_each_groups_units_a_permutation_moved():
    _, spec, state = _mlp()
    permutations = random_permutations(spec, state, torch.Generator().manual_seed(3))
    moved = units_moved(state, [state, permute_state(spec, state, permutations)], spec)
    assert moved == pytest.approx({g: share / 2 for g, share in _shares(permutations).items()})
    assert any(share > 0 for share in moved.values())
    assert units_moved(state, [state], spec) == dict.fromkeys(spec.groups, 0.0)


def test_a_round_records_units_moved_from_its_start_and_between_the_clients():
    """Two clients that hold one model in two unit orders: one left its start's order, and they are apart from
    each other by the whole permutation; without a shared start (independent starts) only the second is known."""
    _, spec, state = _mlp()
    permutations = random_permutations(spec, state, torch.Generator().manual_seed(3))
    clients = [ArrayRecord(state), ArrayRecord(permute_state(spec, state, permutations))]
    row = units_moved_row(ArrayRecord(state), clients, spec)
    assert row[MOVED_FROM_START] == pytest.approx({g: s / 2 for g, s in _shares(permutations).items()})
    assert row[MOVED_BETWEEN] == pytest.approx(_shares(permutations))  # the first client is not counted
    assert units_moved_row(None, clients, spec) == {MOVED_BETWEEN: row[MOVED_BETWEEN]}
    assert units_moved_row(ArrayRecord(state), clients[:1], spec).keys() == {MOVED_FROM_START}


class _Spy(ServerStrategy):
    """Records the reference the round runner hands an aligning strategy."""

    aligns_to_reference = True
    aligns_onto_client = True
    seen: list = []

    def aggregate(self, server_round, replies, reference):
        self.seen.append(reference.to_torch_state_dict()["w"].clone())
        return super().aggregate(server_round, replies, reference)


def test_the_client_reference_is_the_model_of_the_lowest_partition_every_round():
    script = {p: ({"w": torch.full((2,), float(p + 1))}, {"num-examples": 1}) for p in range(3)}
    script[0] = None  # partition 0 fails: partition 1 is the reference
    runner, _ = scripted_runner(script, server=_Spy)
    _Spy.seen.clear()
    for server_round in (1, 2):
        runner.train_round(server_round, ArrayRecord({"w": torch.zeros(2)}))
    assert [w.tolist() for w in _Spy.seen] == [[2.0, 2.0], [2.0, 2.0]]


@pytest.mark.parametrize(
    ("strategy", "keys", "onto_client"),
    [
        ("matched", {}, False),
        ("matched", {"matched-reference": "client"}, True),
        ("matched", {"matched-reference": "iterative"}, False),
        ("matched", {"matched-reference": "iterative", "matched-iterative-start": "client"}, True),
        ("otfusion", {}, False),
        ("otfusion", {"otfusion-reference": "client"}, True),
        ("fedma", {"fedma-matching": "weight", "fedma-reference": "client"}, True),
        ("fedma", {"fedma-matching": "l1", "fedma-reference": "iterative", "fedma-iterative-start": "client"}, True),
        ("fedma", {}, False),
    ],
)
def test_a_strategy_asks_for_a_client_reference_only_when_its_settings_say_so(strategy, keys, onto_client):
    model, _, _ = _mlp()
    run = parse_run_config({"model": "small-mlp", "dataset": "digits", "strategy": strategy, **keys})
    assert get_strategy(strategy).server(build_context(run, model)).aligns_onto_client is onto_client


def test_a_client_reference_aligns_every_client_onto_that_clients_unit_order():
    """Matched onto the first client's model: a second client holding the same model permuted comes back in the
    first client's order, where matching onto the global model would leave both where they are."""
    model, spec, state = _mlp()
    moved = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(4)))
    replies = [_reply(moved, 10, node=1), _reply(state, 30, node=2)]
    run = parse_run_config(
        {"model": "small-mlp", "dataset": "digits", "strategy": "matched", "matched-reference": "client"}
    )
    merge = get_strategy("matched").server(build_context(run, model)).aggregate(1, replies, replies[0].arrays)
    merged = merge.arrays.to_torch_state_dict()
    assert all(torch.allclose(merged[k], moved[k], atol=1e-6) for k in moved)
    assert not torch.allclose(moved["hidden.0.weight"], state["hidden.0.weight"])  # the test can fail


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"strategy": "otfusion", "otfusion-reference": "client", "client-widths": "0.5,1"}, "client-widths"),
        ({"strategy": "otfusion", "otfusion-reference": "first"}, "choose one of \\['client', 'global'\\]"),
        ({"strategy": "matched", "matched-iterative-start": "mean"}, "choose one of \\['client', 'global'\\]"),
        ({"strategy": "fedma", "fedma-reference": "client"}, "'fedma-reference' = 'client' .*BBP-MAP"),
        (
            {"strategy": "fedma", "fedma-reference": "iterative", "fedma-iterative-start": "client"},
            "'fedma-iterative-start' = 'client' .*'weight' or 'l1'",
        ),
        (
            {"strategy": "matched", "matched-reference": "universe", "matched-cost": "l1"},
            "choose one of \\['global', 'iterative', 'client'\\]",
        ),
    ],
)
def test_a_reference_a_strategy_cannot_use_is_refused_before_anything_starts(values, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_run(parse_run_config({"model": "small-mlp", "dataset": "digits", **values}))
