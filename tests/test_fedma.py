"""The ``fedma`` strategy: its stage plan, the per-class output average, the schedule, the client's freezing, and
BBP-MAP's growth on every registered model (or its refusal before the run starts)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

from alignfl.core.data import ClientData
from alignfl.core.merging.bbp import BBPSettings
from alignfl.core.merging.bbp_model import match_group, patch_clients, scatter_group
from alignfl.core.merging.layerwise import completion_plan, frozen_at, per_class_average
from alignfl.core.model_io import federated_state, load_arrays
from alignfl.core.rounds.strategy import Reply
from alignfl.fl_app.config import ConfigError, build_context, check_run, parse_run_config
from alignfl.fl_app.inprocess import run_in_process
from alignfl.models import PermutationSpec, build_model, list_models, permute_state, random_permutations
from alignfl.models.protocol import head_of
from alignfl.models.registry import option_names
from alignfl.strategies import fedma, get_strategy
from alignfl.strategies.fedma import CLASS_COUNTS, STAGE, FedMA, FedMAUpdate
from tests.model_checks import randomise

NUM_CLASSES = 10


def _model(name: str = "small-mlp", seed: int = 0):
    torch.manual_seed(seed)
    return build_model(name, (1, 8, 8), NUM_CLASSES)


def _plan(model: nn.Module) -> list[frozenset[str]]:
    return completion_plan(model.permutation_spec(), federated_state(model), head_of(model).keys)


def test_stages_complete_each_layer_once_its_groups_are_matched():
    model = _model()
    spec, state, head = model.permutation_spec(), federated_state(model), head_of(model).keys
    assert set(head) == {"classifier.weight", "classifier.bias"}
    assert _plan(model) == [{f"hidden.{i}.weight", f"hidden.{i}.bias"} for i in range(4)] + [set(head)]
    assert frozen_at(spec, state, head, 0) == set()
    assert frozen_at(spec, state, head, 4) == set(state) - set(head)


def test_shared_groups_complete_everything_they_carry():
    plan = _plan(_model("transformer-1"))
    assert len(plan) == 5  # stream, attn.qk, attn.v, mlp, output layer
    assert {"embed.weight", "positions", "attn_norm.weight", "attn.out.bias", "final_norm.bias"} <= plan[0]
    assert plan[1] == {"attn.query.weight", "attn.query.bias", "attn.key.weight", "attn.key.bias"}
    assert plan[2] == {"attn.value.weight", "attn.value.bias", "attn.out.weight"}
    resnet = _plan(_model("resnet20"))
    assert "blocks.2.bn2.running_mean" in resnet[0] and "blocks.0.conv2.weight" in resnet[1]


def test_output_rows_are_weighted_by_class_counts():
    a = {"classifier.weight": torch.zeros(3, 2), "classifier.bias": torch.zeros(3)}
    b = {"classifier.weight": torch.ones(3, 2), "classifier.bias": torch.ones(3)}
    counts = torch.tensor([[3, 0, 0], [1, 5, 0]])  # nobody has class 2: example weights 1:3
    averaged = per_class_average([a, b], counts, [1.0, 3.0], ["classifier.weight", "classifier.bias"])
    torch.testing.assert_close(averaged["classifier.bias"], torch.tensor([0.25, 1.0, 0.75]))
    torch.testing.assert_close(averaged["classifier.weight"][:, 0], torch.tensor([0.25, 1.0, 0.75]))


def _reply(state, node: int, counts: torch.Tensor, examples: int = 10) -> Reply:
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: v.clone() for k, v in state.items()}),
            CLASS_COUNTS: ArrayRecord({"counts": counts}),
            "metrics": MetricRecord({"num-examples": examples}),
        }
    )
    return Reply(node, node, content, examples)


def _strategy(model: nn.Module, **config: Any) -> FedMA:
    """FedMA's server side for a small-mlp run with run-config keys ``config``, at the start of a cycle from
    ``model``'s state (as its first training round sets it)."""
    run = parse_run_config({"strategy": "fedma", "model": "small-mlp", "dataset": "digits", **config})
    strategy = get_strategy("fedma").server(build_context(run, model))
    strategy.cycle_start = {k: v.clone() for k, v in federated_state(model).items()}
    return strategy


def _record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: v.clone() for k, v in state.items()})


@pytest.mark.parametrize(("cost", "reference"), [("weight", "global"), ("l1", "global"), ("l1", "iterative")])
def test_a_cycle_matches_a_permuted_client_back_layer_by_layer(cost, reference):
    model = _model()
    spec, state = model.permutation_spec(), federated_state(model)
    permuted = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(1)))
    counts = {1: torch.arange(NUM_CLASSES), 2: torch.arange(NUM_CLASSES).flip(0)}
    strategy = _strategy(model, **{"fedma-matching": cost, "fedma-reference": reference})

    arrays = strategy.aggregate(1, [_reply(state, 1, counts[1]), _reply(permuted, 2, counts[2])], _record(state)).arrays
    assert strategy.stage == 1
    for stage in range(1, 5):  # clients that do not train send back the models they are sent
        assert strategy.stage == stage and sorted(strategy.client_models) == [1, 2]
        replies = [_reply(model, node, counts[node]) for node, model in strategy.client_models.items()]
        arrays = strategy.aggregate(stage + 1, replies, arrays).arrays
    assert strategy.stage == 0 and not strategy.client_models
    final = arrays.to_torch_state_dict()
    assert all(torch.allclose(final[k], state[k], rtol=1e-5, atol=1e-6) for k in state)


def test_bbp_matches_a_permuted_client_onto_the_same_units_without_growth():
    """Units far apart (weights scaled up, so BBP-MAP's cost tells them apart): the permuted copy's units are
    assigned to the original's, the layer keeps its width, and the next layer's inputs follow."""
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20.0)
    spec, state = model.permutation_spec(), federated_state(model)
    perms = random_permutations(spec, state, torch.Generator().manual_seed(1))
    permuted = permute_state(spec, state, perms)
    counts = torch.ones(NUM_CLASSES, dtype=torch.long)
    strategy = _strategy(model)
    merge = strategy.aggregate(1, [_reply(state, 1, counts), _reply(permuted, 2, counts)], _record(state))
    group = next(iter(spec.groups))
    assert merge.metrics["global-width"] == spec.group_sizes(state)  # nothing new opened
    assert merge.groups == {group} and len(merge.unit_maps) == 2
    assert merge.metrics["units-moved"][group] == pytest.approx(
        0.5 * (perms[group] != torch.arange(len(perms[group]))).double().mean()
    )
    aligned = strategy.client_models[2]  # the permuted client, moved back onto the global units
    expected = strategy.client_models[1]["hidden.1.weight"].index_select(0, perms["hidden.1"])  # rows: not matched yet
    torch.testing.assert_close(aligned["hidden.1.weight"], expected)
    assert set(merge.arrays.keys()) == set(state)


def test_a_bbp_stage_may_grow_the_layer_and_the_next_layers_inputs():
    """Two unrelated clients: new global units open, the next layer takes inputs for all of them."""
    first, second = _model(seed=0), _model(seed=1)
    with torch.no_grad():
        for p in (*first.parameters(), *second.parameters()):
            p.mul_(20.0)
    counts = torch.ones(NUM_CLASSES, dtype=torch.long)
    strategy = _strategy(first)
    a, b = federated_state(first), federated_state(second)
    merge = strategy.aggregate(1, [_reply(a, 1, counts), _reply(b, 2, counts)], _record(a))
    grown = merge.arrays.to_torch_state_dict()
    width = grown["hidden.0.weight"].shape[0]
    assert a["hidden.0.weight"].shape[0] < width <= 2 * a["hidden.0.weight"].shape[0]
    assert grown["hidden.1.weight"].shape[1] == width == merge.metrics["global-width"]["hidden.0"]
    assert all(m["hidden.1.weight"].shape[1] == width for m in strategy.client_models.values())


@pytest.mark.parametrize("include", [False, True])
def test_the_last_hidden_layer_is_matched_without_the_classifier_unless_asked(monkeypatch, include):
    """FedMA's default leaves the output layer's weights out of the last hidden layer's units, as the authors'
    code does; ``bbp-include-classifier=true`` puts them in. Every other group reads the same entries."""
    seen = {}

    def recording(*args, **kwargs):
        match = match_group(*args, **kwargs)
        seen[args[3]] = [ref.key for ref in match.refs]
        return match

    monkeypatch.setattr(fedma, "match_group", recording)
    model = _model()
    strategy = _strategy(model, **{"bbp-include-classifier": include})
    counts = torch.ones(NUM_CLASSES, dtype=torch.long)
    state = federated_state(model)
    arrays = strategy.aggregate(1, [_reply(state, 1, counts), _reply(state, 2, counts)], _record(state)).arrays
    for stage in range(1, 4):
        replies = [_reply(client, node, counts) for node, client in strategy.client_models.items()]
        arrays = strategy.aggregate(stage + 1, replies, arrays).arrays
    assert seen["hidden.0"] == ["hidden.0.weight", "hidden.0.bias"]
    assert seen["hidden.2"] == ["hidden.2.weight", "hidden.2.bias"]
    assert seen["hidden.3"] == ["hidden.3.weight", "hidden.3.bias"] + (["classifier.weight"] if include else [])


def test_a_stage_without_usable_replies_restarts_the_cycle():
    """A reply with class counts of the wrong length is refused; a stage where the round runner is left with
    no reply calls ``on_empty_round`` (see test_strategies), which ends the cycle."""
    model = _model()
    state = federated_state(model)
    strategy = _strategy(model)
    strategy.aggregate(1, [_reply(state, 1, torch.ones(NUM_CLASSES, dtype=torch.long))], _record(state))
    assert strategy.stage == 1 and sorted(strategy.client_models) == [1]
    bad_counts = _reply(state, 1, torch.ones(3, dtype=torch.long))
    assert "'class-counts' must hold 'counts': 10 non-negative" in strategy.reply_problem(
        bad_counts.content, _record(state)
    )
    strategy.on_empty_round(2)
    assert strategy.stage == 0 and not strategy.client_models


@pytest.mark.parametrize(("name", "stage"), [("small-mlp", 2), ("resnet20", 1), ("small-mlp", 0)])
def test_the_client_trains_only_what_is_not_matched_yet(name, stage):
    model = _model(name)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, NUM_CLASSES, (32,))
    before = {k: v.clone() for k, v in federated_state(model).items()}
    config = parse_run_config(
        {
            "strategy": "fedma",
            "model": name,
            "dataset": "digits",
            "local-epochs": 1,
            "fedma-retrain-epochs": 2,
            "batch-size": 8,
        }
    )
    update = FedMAUpdate(config, context=None, received=RecordDict({"config": ConfigRecord({STAGE: stage})}))
    update.train(model, x, y, torch.Generator().manual_seed(0), torch.device("cpu"))
    after = federated_state(model)
    frozen = frozen_at(model.permutation_spec(), before, head_of(model).keys, stage)
    assert all(torch.equal(after[k], before[k]) for k in frozen)
    moved = {k for k in before if not torch.equal(after[k], before[k])}
    assert moved and moved.isdisjoint(frozen)
    assert all(p.requires_grad for p in model.parameters())
    counts = update.reply_records(ClientData(x, y, x, y))[CLASS_COUNTS]["counts"].numpy()
    assert counts.tolist() == torch.bincount(y, minlength=NUM_CLASSES).tolist()


def test_fedma_on_digits_completes_a_cycle_and_learns(tmp_path):
    config = {
        "strategy": "fedma",
        "dataset": "digits",
        "num-server-rounds": 4,
        "results-dir": str(tmp_path),
        "device": "cpu",
    }  # mlp: 3 groups + output layer = one cycle
    run_in_process(config, num_nodes=3)
    (folder,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2, 3, 4]
    assert all(row["clients-trained"] == 3 for row in rows[1:])
    assert rows[-1]["accuracy"] > 0.3  # chance is 0.1


TINY_SHAPE, TINY_CLASSES, NEW_UNITS = (3, 8, 8), 4, 3
SCALED = {("transformer-1", "attn.qk"): "attention scores are divided by the square root of the q/k width"}
"""Groups whose zero units still change the output for a reason other than a norm pooling over the group."""


def _tiny(name: str, seed: int) -> nn.Module:
    """Model ``name`` at a tiny width (where it takes ``width-factor``), randomised so every unit differs."""
    torch.manual_seed(seed)
    options = {"width_factor": 0.125} if "width_factor" in option_names(name) else {}
    return randomise(build_model(name, TINY_SHAPE, TINY_CLASSES, **options))


def _with_new_units(state: dict, spec: PermutationSpec, group: str, fresh: dict, count: int) -> dict:
    """``state`` with the first ``count`` units of ``group`` taken from ``fresh`` (units no other client has)."""
    out = dict(state)
    for ref in spec.groups[group]:
        index = torch.arange(count * ref.block)
        out[ref.key] = state[ref.key].index_copy(ref.axis, index, fresh[ref.key].index_select(ref.axis, index))
    return out


def _pools_over(model: nn.Module, spec: PermutationSpec, group: str) -> bool:
    """Whether a norm normalises over the group's units (LayerNorm, GroupNorm): zero units shift its statistics."""
    norms = {name for name, module in model.named_modules() if isinstance(module, (nn.LayerNorm, nn.GroupNorm))}
    return any(ref.key.rpartition(".")[0] in norms for ref in spec.groups[group])


@pytest.mark.parametrize("name", list_models())
def test_bbp_growth_rebuilds_every_registered_model_at_the_new_widths(name):
    """Each group the model lets grow: two clients that differ in a few units, BBP-MAP's stage as FedMA runs it
    (:func:`match_group`, :func:`patch_clients`) opens new units, and a fresh model loading a client's patched
    state runs forward and backward at the new width. Client 0's own units scattered onto the grown group (zeros
    for the new ones, PFNM's patching) compute what client 0 did, unless a norm pools over the group or the
    attention scale reads its width; a group the model keeps at its width is refused on loading, naming it."""
    model, grown = _tiny(name, seed=0), _tiny(name, seed=2)
    spec, state, head = model.permutation_spec(), federated_state(model), head_of(model).keys
    fresh, x = federated_state(_tiny(name, seed=1)), torch.randn(5, *TINY_SHAPE)
    with torch.no_grad():
        expected = model(x)
    sizes = spec.group_sizes(state)
    fixed = next(iter(spec.fixed), None)  # one is enough: the Psi-Nets give every such group one reason
    if fixed is not None:
        wider = scatter_group(state, spec, fixed, torch.arange(sizes[fixed]), sizes[fixed] + 1)
        with pytest.raises(ValueError, match=f"group '{fixed}' cannot change width"):
            load_arrays(grown, ArrayRecord(wider))
    for group in [group for group in spec.groups if group not in spec.fixed]:
        size, others = sizes[group], [g for g in spec.groups if g != group]
        other = _with_new_units(state, spec, group, fresh, min(NEW_UNITS, size))
        settings = BBPSettings(max_width=size + NEW_UNITS)
        match = match_group([state, other], [1.0, 1.0], spec, group, others, settings, head=head)
        assert size < match.width <= size + NEW_UNITS, group
        _, clients = patch_clients([state, other], spec, group, match)
        load_arrays(grown, ArrayRecord({k: v.contiguous() for k, v in clients[1].items()}))
        assert spec.group_sizes(federated_state(grown))[group] == match.width
        grown.zero_grad(set_to_none=True)
        grown(x).sum().backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in grown.parameters()), group
        own = scatter_group(state, spec, group, match.assignments[0], match.width)
        load_arrays(grown, ArrayRecord({k: v.contiguous() for k, v in own.items()}))
        with torch.no_grad():
            output = grown(x)
        assert output.shape == expected.shape and bool(torch.isfinite(output).all()), group
        if not (_pools_over(grown, spec, group) or (name, group) in SCALED):
            torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-5, msg=f"{name} {group}")


@pytest.mark.parametrize("model", ["psi-vgg9", "psi-mobilenet"])
def test_bbp_on_a_model_that_cannot_grow_is_refused_before_the_run(model):
    """A Psi-Net's class groups run as one grouped layer: BBP-MAP, which may widen one of them, is refused by the
    pre-flight check (no data, no training), naming the key; one-to-one matching is accepted."""
    config = {"strategy": "fedma", "model": model, "dataset": "digits", "width-factor": 0.125}
    with pytest.raises(ConfigError, match=r"^run-config key 'fedma-matching' = 'bbp' is not allowed: model") as error:
        check_run(parse_run_config(config))
    assert "cannot change width" in str(error.value) and "\n" not in str(error.value)
    check_run(parse_run_config({**config, "fedma-matching": "weight"}))
