"""Ψ-Net models (alignfl/models/psinet.py) and grouped Ψ-Net averaging (alignfl/strategies/psinet.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from alignfl.core.config import RunConfig
from alignfl.core.data import ClientData
from alignfl.core.model_io import build_run_model, federated_state
from alignfl.core.rounds.strategy import Reply, RunContext
from alignfl.fl_app.config import ConfigError, check_run, parse_run_config
from alignfl.fl_app.inprocess import run_in_process
from alignfl.models import PanSettings, build_model
from alignfl.models.options import WidthOptions
from alignfl.models.protocol import ModelHead
from alignfl.models.psinet import GroupedNorm, PsiNet, PsiOptions, contiguous_class_groups, group_layout, held_groups
from alignfl.models.registry import model_options, option_names
from alignfl.strategies import get_strategy
from alignfl.strategies.psinet import HELD_KEY, HELD_RECORD, PsiNetStrategy, PsiNetUpdate, masked_average

DIGITS = (1, 8, 8)
PAN_ON = PanSettings(mode="mul", period=1.0, amplitude=0.5)


def _psinet_config(**keys: Any) -> RunConfig:
    """A ``psinet`` run of ``psi-vgg9`` on digits with run-config ``keys``."""
    return parse_run_config({"strategy": "psinet", "model": "psi-vgg9", "dataset": "digits", **keys})


def _batch(label: int, size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn((size, *DIGITS), generator=torch.Generator().manual_seed(seed))
    return x, torch.full((size,), label, dtype=torch.long)


# --- the model ------------------------------------------------------------------------


def test_contiguous_mapping_one_to_one_and_one_to_many():
    assert contiguous_class_groups(4, 4) == (0, 1, 2, 3)
    assert contiguous_class_groups(10, 3) == (0, 0, 0, 0, 1, 1, 1, 2, 2, 2)
    assert contiguous_class_groups(100, 10)[:11] == (0,) * 10 + (1,)
    with pytest.raises(ValueError, match="psi-groups"):
        contiguous_class_groups(5, 6)


def test_structure_shared_below_depth_grouped_from_it():
    model = build_model("psi-vgg9", DIGITS, 10, psi_groups=3, psi_depth=2)
    assert isinstance(model.convs[1], nn.Conv2d) and isinstance(model.norms[1], nn.BatchNorm2d)
    assert isinstance(model.norms[2], GroupedNorm) and len(model.norms[2].groups) == 3
    # widths rounded up to a multiple of G: 128 -> 3 x 43; the first grouped conv reads all 64 shared channels
    assert model.convs[2].groups[0].weight.shape == (43, 64, 3, 3)
    assert model.convs[3].groups[0].weight.shape == (43, 43, 3, 3)  # then only its own group
    assert [head.out_features for head in model.classifier.groups] == [4, 3, 3]
    assert model.class_groups == (0, 0, 0, 0, 1, 1, 1, 2, 2, 2)
    assert build_model("psi-vgg9", DIGITS, 10).num_groups == 10  # psi-groups 0: one group per class


def test_layout_splits_every_federated_key_once():
    model = build_model("psi-vgg9", DIGITS, 6, psi_groups=3, psi_depth=3)
    layout = model.layout()
    keys = set(federated_state(model))
    grouped = [key for group in layout.groups for key in group]
    assert set(layout.shared) | set(grouped) == keys and len(layout.shared) + len(grouped) == len(keys)
    assert {"norms.0.running_mean", "norms.2.running_var", "convs.2.weight"} <= set(layout.shared)
    assert len({len(group) for group in layout.groups}) == 1
    assert "norms.3.groups.1.weight" in layout.groups[1] and "classifier.groups.2.bias" in layout.groups[2]
    assert layout.keys_for([2])[-1] == "classifier.groups.2.bias"
    assert layout == group_layout(federated_state(model).keys())  # what the server reads from key names alone
    with pytest.raises(ValueError, match="do not exist"):
        layout.keys_for([3])


@pytest.mark.parametrize("depth", [0, 5, 8])
def test_permutations_stay_inside_groups_and_preserve_the_function(depth):
    from alignfl.models import permute_state, random_permutations

    torch.manual_seed(0)
    model = build_model("psi-vgg9", DIGITS, 6, psi_groups=3, psi_depth=depth).eval()
    spec, state = model.permutation_spec(), model.state_dict()
    layout = model.layout()
    for name, refs in spec.groups.items():
        owners = {g for ref in refs for g, keys in enumerate(layout.groups) if ref.key in keys}
        if ".groups." in name:  # units of one group move only within that group's keys
            assert len(owners) == 1
        else:  # shared units are read by every branch, but only as their inputs
            assert all(ref.axis == 1 for ref in refs if ref.key not in layout.shared)
    perms = random_permutations(spec, state, torch.Generator().manual_seed(1))
    x, _ = _batch(0)
    with torch.no_grad():
        before = model(x)
        model.load_state_dict(permute_state(spec, state, perms))
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)


def test_bad_options_name_the_key():
    with pytest.raises(ValueError, match=r"psi-depth must be an int in \[0, 8\]"):
        build_model("psi-vgg9", DIGITS, 10, psi_depth=9)
    with pytest.raises(ValueError, match="psi-groups"):
        build_model("psi-vgg9", DIGITS, 4, psi_groups=5)
    with pytest.raises(ValueError, match=r"takes no option\(s\) \['psi_groups'\]"):
        build_model("vgg9", DIGITS, 10, psi_groups=2)
    assert model_options("psi-vgg11") is PsiOptions and model_options("vgg9") is WidthOptions
    assert set(option_names("psi-vgg11")) == {"psi_groups", "psi_depth", "width_factor"}
    assert option_names("vgg9") == ("width_factor",)


def test_run_config_reaches_the_builder():
    config = parse_run_config({"model": "psi-vgg11", "dataset": "digits", "psi-groups": 5, "psi-depth": 3})
    model = build_run_model(config, SimpleNamespace(input_shape=DIGITS, num_classes=10))
    assert (model.num_groups, model.depth, model.class_groups[:3]) == (5, 3, (0, 0, 1))
    # more groups than digits' 10 classes: refused before the run starts, once the model is built
    with pytest.raises(ConfigError, match=r"model 'psi-vgg9' with 'digits': psi-groups must lie in .*got 11"):
        check_run(parse_run_config({"model": "psi-vgg9", "dataset": "digits", "psi-groups": 11}))
    with pytest.raises(ConfigError, match="'psi-depth' = -1 is not allowed"):
        parse_run_config({"model": "psi-vgg9", "psi-depth": -1})


def test_run_config_defaults_are_the_builder_defaults():
    config = parse_run_config({"model": "psi-vgg9", "dataset": "digits"})
    assert config.model_options == PsiOptions()
    from_run = build_run_model(config, SimpleNamespace(input_shape=DIGITS, num_classes=10))
    built = build_model("psi-vgg9", DIGITS, 10)
    assert (from_run.num_groups, from_run.depth) == (built.num_groups, built.depth) == (10, PsiOptions().psi_depth)


def test_held_groups_follow_the_labels():
    assert held_groups((0, 0, 1, 1, 2), torch.tensor([4, 0, 1, 0])) == (0, 2)


# --- gradient isolation ---------------------------------------------------------------


def _grouped_grads(model: PsiNet) -> dict[int, float]:
    """Largest |gradient| over each group's parameters."""
    layout = model.layout()
    params = dict(model.named_parameters())
    largest = {}
    for g, keys in enumerate(layout.groups):
        grads = [params[k].grad for k in keys if k in params and params[k].grad is not None]
        largest[g] = max((grad.abs().max().item() for grad in grads), default=0.0)
    return largest


@pytest.mark.parametrize("pan", [None, PAN_ON], ids=["pan-off", "pan-on"])
@pytest.mark.parametrize(("groups", "depth"), [(10, 2), (3, 0), (3, 5), (4, 8)])
def test_class_logit_gradient_reaches_only_its_group(groups, depth, pan):
    torch.manual_seed(0)
    model = build_model("psi-vgg9", DIGITS, 10, pan, psi_groups=groups, psi_depth=depth)
    for label in (0, 9):
        model.zero_grad(set_to_none=True)
        x, _ = _batch(label)
        model(x)[:, label].sum().backward()  # class c's confidence Z_c (Eq. 2)
        largest = _grouped_grads(model)
        mine = model.class_groups[label]
        assert largest[mine] > 0
        assert all(value == 0.0 for g, value in largest.items() if g != mine), largest


def test_trimmed_loss_gives_zero_gradient_outside_the_held_groups():
    """A client holding classes 0 and 1 (group 0 of three) trains on class 0: groups 1 and 2 get nothing."""
    torch.manual_seed(0)
    model = build_model("psi-vgg9", DIGITS, 10, psi_groups=3, psi_depth=2)
    update = PsiNetUpdate(_psinet_config(**{"local-epochs": 1, "batch-size": 4}), context=None)
    x, y = _batch(0, size=8)
    update.train(model, x, torch.tensor([0, 1] * 4), torch.Generator().manual_seed(0), torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    update.loss(model, x, y).backward()
    largest = _grouped_grads(model)
    assert largest[0] > 0 and largest[1] == 0.0 and largest[2] == 0.0
    # the full softmax would leak: the other groups' logits sit in its normaliser
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    assert _grouped_grads(model)[1] > 0


# --- client trimming ------------------------------------------------------------------


def test_client_trains_and_sends_only_shared_and_held_groups():
    torch.manual_seed(0)
    model = build_model("psi-vgg9", DIGITS, 6, psi_groups=3, psi_depth=2)  # groups: {0,1}, {2,3}, {4,5}
    before = {k: v.clone() for k, v in federated_state(model).items()}
    x = torch.randn((12, *DIGITS), generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 5] * 6)  # holds groups 0 and 2
    update = PsiNetUpdate(_psinet_config(**{"local-epochs": 2, "batch-size": 4, "weight-decay": 0.1}), context=None)
    metrics = update.train(model, x, y, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert metrics["groups-held"] == 2.0

    layout = model.layout()
    sent = update.model_record(model)
    assert list(sent.keys()) == list(layout.keys_for([0, 2]))
    assert not set(sent) & set(layout.groups[1])
    assert update.reply_records(ClientData(x, y, x, y))[HELD_RECORD][HELD_KEY].numpy().tolist() == [0, 2]

    after = federated_state(model)
    assert all(torch.equal(after[k], before[k]) for k in layout.groups[1])  # trimmed: untouched, even by decay
    for keys in (layout.shared, layout.groups[0], layout.groups[2]):
        assert any(not torch.equal(after[k], before[k]) for k in keys)


def test_psinet_needs_a_psinet_model():
    update = PsiNetUpdate(_psinet_config(), context=None)
    with pytest.raises(ValueError, match="needs a Ψ-Net model"):
        update.train(build_model("vgg9", DIGITS, 3), *_batch(0), torch.Generator(), torch.device("cpu"))
    with pytest.raises(ConfigError, match="'model' = 'vgg9' is not allowed with strategy 'psinet'"):
        check_run(_psinet_config(model="vgg9"))


# --- server aggregation ---------------------------------------------------------------

SHARED = "convs.0.weight"
GROUPED = ("convs.1.groups.{}.weight", "classifier.groups.{}.bias")
GLOBAL = {
    SHARED: np.full((2, 2), -1.0, np.float32),
    **{key.format(g): np.full(3, -10.0 * (g + 1), np.float32) for g in range(3) for key in GROUPED},
}


def _reply(
    held: list[int],
    value: float,
    examples: int,
    node: int = 1,
    *,
    arrays: dict | None = None,
    declared: list[int] | None = None,
) -> Reply:
    """A reply carrying shared and held-group arrays all equal to ``value`` (or ``arrays`` as given)."""
    if arrays is None:
        keys = [SHARED] + [key.format(g) for g in held for key in GROUPED]
        arrays = {k: np.full_like(GLOBAL[k], value) for k in keys}
    declared = held if declared is None else declared
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: torch.from_numpy(v) for k, v in arrays.items()}),
            HELD_RECORD: ArrayRecord({HELD_KEY: torch.tensor(declared, dtype=torch.int64)}),
            "metrics": MetricRecord({"num-examples": examples}),
        }
    )
    return Reply(node, node, content, examples)


def _reference() -> ArrayRecord:
    return ArrayRecord({k: torch.from_numpy(v) for k, v in GLOBAL.items()})


def _strategy() -> PsiNetStrategy:
    """The server side for a model whose federated state is :data:`GLOBAL` (three groups)."""
    head = ModelHead(tuple(GROUPED[1].format(g) for g in range(3)), 3)
    context = RunContext(_psinet_config(), _reference(), None, head, group_layout(GLOBAL))
    return get_strategy("psinet").server(context)


def test_shared_over_all_groups_over_holders_absent_group_keeps_its_value():
    replies = [_reply([0], 1.0, 1, node=1), _reply([0, 1], 2.0, 3, node=2), _reply([1], 4.0, 2, node=3)]
    strategy = _strategy()
    assert all(strategy.reply_problem(reply.content, _reference()) is None for reply in replies)
    arrays = strategy.aggregate(1, replies, _reference()).arrays
    np.testing.assert_allclose(arrays[SHARED].numpy(), np.full((2, 2), (1 + 6 + 8) / 6), rtol=1e-6)
    for key in GROUPED:
        np.testing.assert_allclose(arrays[key.format(0)].numpy(), np.full(3, (1 + 6) / 4), rtol=1e-6)
        np.testing.assert_allclose(arrays[key.format(1)].numpy(), np.full(3, (6 + 8) / 5), rtol=1e-6)
        assert np.array_equal(arrays[key.format(2)].numpy(), GLOBAL[key.format(2)])  # nobody holds group 2
    assert list(arrays.keys()) == list(GLOBAL)


def test_masked_average_is_exact_per_key():
    reference = ArrayRecord({"a": torch.zeros(2), "b": torch.full((2,), 7.0)})
    models = [ArrayRecord({"a": torch.tensor([1.0, 2.0])}), ArrayRecord({"a": torch.tensor([4.0, 8.0])})]
    averaged = masked_average(reference, models, [1.0, 2.0])
    np.testing.assert_allclose(averaged["a"].numpy(), [3.0, 6.0], rtol=1e-7)
    assert averaged["b"].numpy().tolist() == [7.0, 7.0]


def _good_arrays(held):
    return {k: np.zeros_like(GLOBAL[k]) for k in [SHARED] + [key.format(g) for g in held for key in GROUPED]}


@pytest.mark.parametrize(
    ("reply", "fragment"),
    [
        (_reply([0], 9.0, 1, declared=[1]), "missing ['classifier.groups.1.bias'"),  # sends a group it does not hold
        (
            _reply([0], 0.0, 1, arrays={**_good_arrays([0]), "convs.1.groups.1.weight": np.zeros(3, np.float32)}),
            "unexpected ['convs.1.groups.1.weight']",
        ),
        (
            _reply([0], 0.0, 1, arrays={**_good_arrays([0]), SHARED: np.zeros((2, 3), np.float32)}),
            "shape (2, 3), expected (2, 2)",
        ),
        (
            _reply([0], 0.0, 1, arrays={k: v for k, v in _good_arrays([0]).items() if k != SHARED}),
            "missing ['convs.0.weight']",
        ),
        (_reply([0], 0.0, 1, declared=[3]), "distinct group ids in 0..2"),
        (_reply([0], 0.0, 1, declared=[]), "non-empty 1-D integer array"),
    ],
    ids=["undeclared-group", "extra-group-key", "wrong-shape", "missing-shared", "bad-id", "no-groups"],
)
def test_malformed_reply_is_refused(reply, fragment):
    """The round runner drops a reply the server side refuses: it never reaches ``aggregate``, and a round
    left without replies keeps the global model (see test_strategies)."""
    problem = _strategy().reply_problem(reply.content, _reference())
    assert problem is not None and fragment in problem
    assert _strategy().reply_problem(_reply([0], 2.0, 1, node=2).content, _reference()) is None


def test_reply_without_the_groups_record_is_refused():
    content = RecordDict({k: v for k, v in _reply([0], 1.0, 1).content.items() if k != HELD_RECORD})
    assert "missing ArrayRecord 'psi-groups'" in _strategy().reply_problem(content, _reference())


# --- the real apps in one process ----------------------------------------------------


@pytest.mark.slow  # a convolutional net: ~15 s on two loaded cores
def test_psinet_on_digits_pathological(tmp_path: Path):
    config = {
        "dataset": "digits",
        "model": "psi-vgg9",
        "strategy": "psinet",
        "partitioner": "pathological",
        "classes-per-client": 4,
        "psi-groups": 5,
        "num-server-rounds": 2,
        "pan-mode": "mul",
        "pan-a": 0.2,
        "results-dir": str(tmp_path),
        "device": "cpu",
    }
    run_in_process(config, num_nodes=3)
    (folder,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2]
    assert rows[-1]["clients-trained"] == 3
    assert 1.0 <= rows[-1]["groups-held"] < 5.0  # 4 of 10 classes cover at most 4 of 5 groups: trimming happened
    model = build_model("psi-vgg9", DIGITS, 10, psi_groups=5)
    model.load_state_dict(torch.load(folder / "model.pt"))


# --- depth analysis -------------------------------------------------------------------


def test_total_variance_of_constructed_preferences():
    from alignfl.fl_app.analysis.depth import total_variance

    preferences = {
        "specialised": torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]),  # the dead third unit is left out
        "uniform": torch.tensor([[0.5, 0.5], [0.5, 0.5]]),
        "dead": torch.zeros(3, 2),
    }
    tv = total_variance(preferences)
    assert tv["specialised"] == pytest.approx(0.5**0.5) and tv["uniform"] == 0.0 and np.isnan(tv["dead"])


def test_suggested_depth_is_the_largest_rise():
    from alignfl.fl_app.analysis.common import AnalysisError
    from alignfl.fl_app.analysis.depth import suggest_depth

    assert suggest_depth([0.1, 0.2, 0.6, 0.65, 0.3]) == 2
    with pytest.raises(AnalysisError, match="at least two layers"):
        suggest_depth([0.4])


def test_depth_command_writes_json_and_plot(tmp_path: Path):
    from alignfl.fl_app.analysis.__main__ import main

    assert (
        main(["depth", "--model", "twocnn", "--dataset", "digits", "--samples-per-class", "3", "--out", str(tmp_path)])
        == 0
    )
    payload = json.loads((tmp_path / "depth.json").read_text())
    assert payload["layers"] == ["convs.0", "convs.1", "fcs.0"] and len(payload["total_variance"]) == 3
    assert 1 <= payload["suggested_psi_depth"] <= 2 and (tmp_path / "depth.png").stat().st_size > 0
    assert main(["depth", "--out", str(tmp_path)]) == 2  # neither a run nor a fresh model
