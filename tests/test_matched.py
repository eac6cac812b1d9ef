"""The ``matched`` strategy: aggregation of permuted client models, its config keys, and one simulation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

import alignfl.models.registry as model_registry
from alignfl.core.rounds.strategy import Reply, ServerStrategy
from alignfl.fl_app.config import ConfigError, build_context, check_run, parse_run_config
from alignfl.fl_app.inprocess import run_in_process
from alignfl.models import PanSettings, build_model, permute_state, random_permutations
from alignfl.strategies import get_strategy

PAN_ON = {"pan-mode": "mul", "pan-t": 1.0, "pan-a": 0.5}


def _reply(state: dict[str, torch.Tensor], examples: int, node: int) -> Reply:
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: v.clone() for k, v in state.items()}),
            "metrics": MetricRecord({"num-examples": examples}),
        }
    )
    return Reply(node, node, content, examples)


def _server(model: nn.Module, strategy: str, **config: Any) -> ServerStrategy:
    """The server side of ``strategy`` for a small-mlp run on digits with run-config keys ``config``."""
    run = parse_run_config({"model": "small-mlp", "dataset": "digits", "strategy": strategy, **config})
    return get_strategy(strategy).server(build_context(run, model))


def _model_state(pan: dict[str, Any] | None = None, seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    settings = PanSettings(pan["pan-mode"], pan["pan-t"], pan["pan-a"]) if pan else None
    model = build_model("small-mlp", (1, 8, 8), 10, settings)
    return model, model.permutation_spec(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: v.clone() for k, v in state.items()})


def _close(actual: ArrayRecord, expected: dict[str, torch.Tensor]) -> bool:
    got = actual.to_torch_state_dict()
    return got.keys() == expected.keys() and all(
        torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-6) for k in expected
    )


@pytest.mark.parametrize("pan", [{}, PAN_ON], ids=["pan-off", "pan-on"])
@pytest.mark.parametrize(("cost", "reference"), [("weight", "global"), ("l1", "global"), ("weight", "iterative")])
def test_a_permuted_copy_of_a_client_is_averaged_back_to_the_model(cost, reference, pan):
    model, spec, state = _model_state(pan)
    permuted = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(1)))
    replies = [_reply(state, 10, node=1), _reply(permuted, 30, node=2)]

    strategy = _server(model, "matched", **{"matched-cost": cost, "matched-reference": reference, **pan})
    assert _close(strategy.aggregate(1, replies, _record(state)).arrays, state)

    plain = _server(model, "fedavg", **pan).aggregate(1, replies, _record(state)).arrays
    assert not _close(plain, state)  # the test can fail: plain averaging mixes unrelated units


def test_clients_are_aligned_onto_the_global_model_they_started_from():
    """Two clients holding the same permuted model average to that model put back in the global order."""
    model, spec, state = _model_state()
    permuted = permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(3)))
    replies = [_reply(permuted, 5, 1), _reply(permuted, 7, 2)]
    assert _close(_server(model, "matched").aggregate(1, replies, _record(state)).arrays, state)


@pytest.mark.parametrize("reference", ["global", "universe"])
def test_the_merge_returns_its_unit_maps_and_metrics_and_leaves_nothing_on_the_strategy(reference):
    """What REPAIR, the round's row and the merge tool read comes back in the Merge: each reply's map carries its
    units onto the merged ones, and the units-moved share counts the units it moved."""
    model, spec, state = _model_state()
    perms = random_permutations(spec, state, torch.Generator().manual_seed(5))
    permuted = permute_state(spec, state, perms)
    strategy = _server(model, "matched", **{"matched-reference": reference})
    before = dict(vars(strategy))
    merge = strategy.aggregate(1, [_reply(state, 1, 1), _reply(permuted, 3, 2)], _record(state))
    assert vars(strategy).keys() == before.keys()  # the strategy keeps nothing of the round for others to read
    assert _close(merge.arrays, state) and merge.groups is None
    aligned = [permute_state(spec, s, maps) for s, maps in zip((state, permuted), merge.unit_maps, strict=True)]
    assert all(_close(_record(a), state) for a in aligned)  # the maps carry each reply onto the merged units
    moved = {g: float((perms[g] != torch.arange(len(perms[g]))).double().mean()) / 2 for g in spec.groups}
    assert merge.metrics["units-moved"] == pytest.approx(moved)  # one of the two replies moved
    assert merge.metrics["global-width"] == spec.group_sizes(state)
    assert ("cycle-consistency-error" in merge.metrics) == (reference == "universe")


def test_a_reply_that_does_not_fit_is_refused_and_the_others_are_matched():
    """The round runner drops a reply the server side refuses (and keeps the global model when none is left,
    see test_strategies), so only the fitting replies reach ``aggregate``."""
    model, _, state = _model_state()
    bad = dict(state, **{"hidden.0.bias": torch.zeros(7)})
    strategy = _server(model, "matched")
    problem = strategy.reply_problem(_reply(bad, 5, 2).content, _record(state))
    assert problem is not None and "'hidden.0.bias'" in problem and "shape (7,)" in problem
    assert strategy.reply_problem(_reply(state, 5, 1).content, _record(state)) is None
    assert _close(strategy.aggregate(1, [_reply(state, 5, 1)], _record(state)).arrays, state)


class _PlainLinear(nn.Module):
    """A network with the head every model has (``classifier``) but no permutation description."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x.flatten(1))


def test_a_model_without_a_permutation_spec_is_refused_before_training(monkeypatch):
    monkeypatch.setattr(model_registry.MODELS, "_entries", dict(model_registry.MODELS._entries))
    model_registry.MODELS.register(
        model_registry.Model("plain-linear", lambda shape, classes, pan: _PlainLinear(classes))
    )
    config = parse_run_config({"strategy": "matched", "model": "plain-linear", "dataset": "digits"})
    with pytest.raises(
        ConfigError,
        match=r"'model' = 'plain-linear' is not allowed with strategy 'matched'.*"
        r"no permutation description",
    ):
        check_run(config)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("matched-cost", "cosine", "'l1'"),
        ("matched-reference", "clients", "'client'"),
        ("matched-iterations", 0, ">= 1"),
    ],
)
def test_bad_matching_keys_are_refused_with_what_is_allowed(key, value, fragment):
    with pytest.raises(ConfigError) as error:
        parse_run_config({"strategy": "matched", key: value})
    assert f"'{key}'" in str(error.value) and fragment in str(error.value)


def test_matched_on_digits_completes_and_learns(tmp_path: Path):
    config = {
        "strategy": "matched",
        "dataset": "digits",
        "num-server-rounds": 2,
        "results-dir": str(tmp_path),
        "device": "cpu",
    }
    run_in_process(config, num_nodes=3)
    (folder,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2]
    assert rows[-1]["clients-trained"] == 3
    assert rows[-1]["accuracy"] > 0.3  # chance is 0.1 on ten classes


def test_a_run_whose_alignment_moves_no_unit_is_fedavgs_run_to_the_last_bit(tmp_path: Path):
    """Clients of one start keep their units in place here; matched averaging's and OT fusion's runs must then be
    FedAvg's, model and metrics, not runs that float rounding in the merge sets apart (a spread long local training
    grows). Two rounds: the second starts from the first's merge."""
    runs = {}
    for name in ("fedavg", "matched", "otfusion"):
        config = {"strategy": name, "dataset": "digits", "num-server-rounds": 2, "device": "cpu"}
        run_in_process({**config, "results-dir": str(tmp_path / name), "run-name": "run"}, num_nodes=3)
        folder = tmp_path / name / "run"
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        runs[name] = rows, torch.load(folder / "model.pt")
    fedavg_rows, fedavg_model = runs.pop("fedavg")
    for name, (rows, model) in runs.items():
        moved = [row.get("units-moved") or row["transport-off-diagonal"] for row in rows[1:]]
        assert all(max(share.values()) < 1e-12 for share in moved), (name, moved)
        assert [row["accuracy"] for row in rows] == [row["accuracy"] for row in fedavg_rows], name
        assert all(torch.equal(model[key], fedavg_model[key]) for key in fedavg_model), name
