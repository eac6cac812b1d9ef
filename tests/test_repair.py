"""REPAIR (``repair=on``): the correction, the query messages after the merge, faults, resume, refusals.

Jordan, Sedghi, Saukh, Entezari and Neyshabur, "REPAIR: REnormalizing Permuted Activations for Interpolation
Repair", ICLR 2023. The federated runs use the in-process engine (and the batched one, which must give the same
rows); Flower's Ray simulation is compared once (long).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from flwr.app import Error, Message, MessageType
from flwr.common.constant import ErrorCode
from flwr.supercore.task_identity import TaskIdentity

from alignfl.core.data import load_dataset
from alignfl.core.merging.alignment import align_and_average, matching_generator, weighted_average
from alignfl.core.merging.repair import (
    UnitStats,
    averaged,
    carry_statistics,
    find_sites,
    repair_in_order,
    unit_statistics,
)
from alignfl.core.model_io import build_run_model
from alignfl.core.rounds.repair_round import QUERY_KEY, REPAIR_QUERY
from alignfl.fl_app import server_app
from alignfl.fl_app.analysis.merge import repair_merge, train_clients
from alignfl.fl_app.checkpoint import load_checkpoint, save_checkpoint
from alignfl.fl_app.client_app import build_client_app, client_data
from alignfl.fl_app.config import ConfigError, check_run, parse_run_config
from alignfl.fl_app.engines.batched import run_batched
from alignfl.fl_app.inprocess import InProcessGrid, run_in_process
from alignfl.fl_app.server_app import run_experiment
from alignfl.models import PanSettings, build_model
from alignfl.models.registry import option_names

CPU = torch.device("cpu")
RUN = {
    "strategy": "matched",
    "model": "small-mlp",
    "dataset": "digits",
    "device": "cpu",
    "num-server-rounds": 2,
    "batch-size": 16,
    "data-fraction": 0.3,
    "repair": "on",
}


@pytest.fixture(autouse=True)
def _server_identity(monkeypatch):
    """Flower stamps every message with the process's task identity, which its runtimes set; here none runs."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _rows(folder: Path) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed-s"} for line in lines]


def _model(name: str) -> torch.nn.Module:
    options = {"width_factor": 0.25} if "width_factor" in option_names(name) else {}
    return build_model(name, (1, 8, 8), 10, PanSettings(), **options).double()


def _shaken(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The model's state with new random weights, and BatchNorm running statistics away from 0 and 1."""
    torch.manual_seed(seed)
    state = {}
    for key, value in model.state_dict().items():
        if not value.is_floating_point():
            state[key] = value
        elif key.endswith("running_var"):
            state[key] = torch.rand_like(value) + 0.5
        elif key.endswith("running_mean"):
            state[key] = torch.randn_like(value) * 0.1
        else:
            spread = value.std().clamp(min=0.1) if value.numel() > 1 else torch.tensor(0.1, dtype=value.dtype)
            state[key] = value + torch.randn_like(value) * spread
    return state


# --- the correction ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["small-mlp", "vgg9-bn", "vgg9-gn", "psi-vgg9"])
def test_on_the_same_data_every_merged_unit_gets_exactly_the_target_mean_and_std(name):
    """Linear layers, BatchNorm (running statistics), GroupNorm and a Ψ-Net's grouped layers: three models merged,
    every client's statistics taken on the same data, every layer corrected in order."""
    model = _model(name)
    x = load_dataset("digits").train_x[:256].double()
    sites = find_sites(model, (1, 8, 8), model.permutation_spec())
    states = [_shaken(model, seed) for seed in range(3)]
    weights = [3.0, 1.0, 2.0]

    def statistics(state: dict[str, torch.Tensor]) -> dict[str, UnitStats]:
        model.load_state_dict(state)
        values = unit_statistics(model, sites, x, CPU)
        return {s.name: UnitStats.whole(values[f"{s.name}.mean"], values[f"{s.name}.std"]) for s in sites}

    targets = [statistics(state) for state in states]
    merged = weighted_average(states, weights)
    repaired, _ = repair_in_order(
        merged, sites, targets, weights, lambda state, site: [statistics(state)[site.name]] * 3
    )
    after = statistics(repaired)
    for site in sites:
        goal = averaged([t[site.name] for t in targets], weights)
        assert torch.allclose(after[site.name].mean, goal.mean, atol=1e-6, rtol=0), site.name
        assert torch.allclose(after[site.name].std, goal.std, atol=1e-6, rtol=0), site.name
    before = statistics(merged)
    assert any(not torch.allclose(before[s.name].std, after[s.name].std, atol=1e-3) for s in sites)


@pytest.mark.parametrize("name", ["small-mlp", "vgg9-bn"])
def test_a_model_every_client_holds_is_left_unchanged_on_non_iid_data(name):
    model = _model(name)
    digits = load_dataset("digits")
    by_class = [digits.train_x[digits.train_y == c][:60].double() for c in (0, 3, 7)]  # three clients, other classes
    sites = find_sites(model, (1, 8, 8), model.permutation_spec())
    state = _shaken(model, 5)
    model.load_state_dict(state)

    def measure(current: dict[str, torch.Tensor]) -> list[dict[str, UnitStats]]:
        model.load_state_dict(current)
        shapes = {k: tuple(v.shape) for k, v in current.items()}
        return [carry_statistics(unit_statistics(model, sites, x, CPU), sites, shapes, shapes) for x in by_class]

    def measure_site(current: dict[str, torch.Tensor], site) -> list[UnitStats]:
        return [statistics[site.name] for statistics in measure(current)]

    repaired, corrections = repair_in_order(state, sites, measure(state), [60.0, 30.0, 10.0], measure_site)
    assert all(torch.equal(fix.scale, torch.ones_like(fix.scale)) for fix in corrections.values())
    assert all(torch.equal(fix.shift, torch.zeros_like(fix.shift)) for fix in corrections.values())
    assert all(torch.equal(repaired[k], state[k]) for k in state)


def test_statistics_are_carried_by_permutations_couplings_and_first_units():
    mean, std = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.1, 0.2, 0.3])
    model = _model("small-mlp")
    sites = find_sites(model, (1, 8, 8), model.permutation_spec())[:1]
    shapes = {"hidden.0.weight": (3, 64)}
    record = {"hidden.0.mean": mean, "hidden.0.std": std}
    moved = carry_statistics(record, sites, shapes, shapes, {"hidden.0": torch.tensor([2, 0, 1])})["hidden.0"]
    assert moved.mean.tolist() == [3.0, 1.0, 2.0] and moved.held.all()
    coupling = torch.tensor([[0.0, 0.5], [0.0, 0.5], [1.0, 0.0]])  # 3 client units onto 2 merged units
    fused = carry_statistics(record, sites, shapes, {"hidden.0.weight": (2, 64)}, {"hidden.0": coupling})["hidden.0"]
    assert fused.mean.tolist() == pytest.approx([3.0, 1.5])
    wider = carry_statistics(record, sites, shapes, {"hidden.0.weight": (5, 64)})["hidden.0"]
    assert wider.held.tolist() == [True, True, True, False, False] and wider.mean[:3].tolist() == [1.0, 2.0, 3.0]
    trimmed = carry_statistics(record, sites, shapes, shapes, held_pieces=set())["hidden.0"]
    assert not trimmed.held.any()


# --- the protocol --------------------------------------------------------------------------------------------


def test_the_rounds_are_repaired_alike_on_the_in_process_and_batched_engines(tmp_path):
    values = {**RUN, "results-dir": str(tmp_path)}
    run_in_process({**values, "run-name": "inprocess"}, 3)
    run_batched({**values, "run-name": "batched"}, 3, vectorise="off")
    rows = _rows(tmp_path / "inprocess")
    assert rows == _rows(tmp_path / "batched")
    for row in rows[1:]:
        assert (row["repair"], row["repair-clients"], row["repair-layers"]) == ("on", 3, 4)
        assert row["repair-std-change"] > 0 and row["repair-dropped-reasons"] == {}
    plain = {**values, "repair": "off", "run-name": "plain"}
    run_in_process(plain, 3)
    assert _rows(tmp_path / "plain")[1]["loss"] != rows[1]["loss"]  # the repair changed the global model


def test_a_one_shot_run_repairs_as_the_merge_tool_does(tmp_path):
    one_shot = {**RUN, "num-server-rounds": 1, "client-init": "independent", "local-epochs": 2, "seed": 3}
    run_in_process({**one_shot, "results-dir": str(tmp_path), "run-name": "run"}, 3)
    config = parse_run_config(one_shot)
    states, counts, dataset, _ = train_clients(config, 3, same_init=False, device=CPU)
    model = build_run_model(config, dataset)
    merged, permutations = align_and_average(
        states[0], states, counts, model.permutation_spec(), "weight", 1, matching_generator(config.seed, 1)
    )
    data = [client_data(config, k, 3).train_x for k in range(3)]
    expected = repair_merge(model, merged, states, permutations, data, counts, CPU)
    got = torch.load(tmp_path / "run" / "model.pt")
    assert all(torch.allclose(got[k], expected[k], rtol=0, atol=1e-6) for k in expected)
    assert not all(torch.allclose(got[k], merged[k]) for k in merged)


def _pooled_case() -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]], list[torch.Tensor], list[float]]:
    """A small MLP, three random states and three clients' inputs of different classes (non-IID)."""
    model = build_model("small-mlp", (1, 8, 8), 10, PanSettings())
    digits = load_dataset("digits")
    data = [
        digits.train_x[(digits.train_y >= low) & (digits.train_y < high)][:90]
        for low, high in ((0, 4), (4, 7), (7, 10))
    ]
    return model, [_shaken(model, seed) for seed in range(3)], data, [float(len(x)) for x in data]


def test_pooled_repair_gives_every_unit_the_endpoints_statistics_on_the_union_of_the_clients_data():
    """``--repair-data pooled`` against a direct computation: on the pooled inputs, the first layer's correction
    from the endpoints' and the merge's pre-activations by hand, and every layer's statistics after REPAIR equal to
    the examples-weighted mean of the endpoints' (REPAIR's interpolation, all measured on one data set)."""
    model, states, data, weights = _pooled_case()
    merged = weighted_average(states, weights)
    repaired = repair_merge(model, merged, states, [{}] * 3, data, weights, CPU, "pooled")
    pool = torch.cat(data).flatten(1).double()

    def pre_activation(state: dict[str, torch.Tensor]) -> torch.Tensor:
        return pool @ state["hidden.0.weight"].double().T + state["hidden.0.bias"].double()

    ends = [pre_activation(state) for state in states]
    share = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    goal_mean = sum(w * h.mean(0) for w, h in zip(share, ends))
    goal_std = sum(w * h.std(0, unbiased=False) for w, h in zip(share, ends))
    own = pre_activation(merged)
    scale = goal_std / own.std(0, unbiased=False)
    shift = goal_mean - scale * own.mean(0)
    expected_weight = scale[:, None] * merged["hidden.0.weight"].double()
    assert torch.allclose(repaired["hidden.0.weight"].double(), expected_weight, atol=1e-5, rtol=1e-5)
    assert torch.allclose(repaired["hidden.0.bias"].double(), scale * merged["hidden.0.bias"] + shift, atol=1e-5)
    sites = find_sites(model, (1, 8, 8), model.permutation_spec())

    def statistics(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        model.load_state_dict(state)
        return unit_statistics(model, sites, torch.cat(data), CPU)

    after, endpoints = statistics(repaired), [statistics(state) for state in states]
    for key, values in after.items():
        goal = sum(w * end[key] for w, end in zip(share, endpoints))
        assert torch.allclose(values, goal, atol=1e-4, rtol=1e-4), key


def test_pooled_repair_differs_from_own_on_non_iid_data_and_equals_it_where_the_data_are_one():
    model, states, data, weights = _pooled_case()
    merged = weighted_average(states, weights)

    def both(states, data, weights) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        merged = weighted_average(states, weights)
        maps = [{}] * len(states)
        own = repair_merge(model, merged, states, maps, data, weights, CPU, "own")
        return own, repair_merge(model, merged, states, maps, data, weights, CPU, "pooled")

    own, pooled = both(states, data, weights)
    assert not all(torch.allclose(own[k], pooled[k], atol=1e-4) for k in own)  # each client's classes differ
    own, pooled = both(states[:1], data[:1], weights[:1])  # one client: its own data are the union
    assert all(torch.allclose(own[k], pooled[k], atol=1e-5, rtol=1e-5) for k in own)
    own, pooled = both(states, [data[0]] * 3, weights)  # every client holds the same data
    assert all(torch.allclose(own[k], pooled[k], atol=1e-5, rtol=1e-5) for k in own)
    assert not all(torch.allclose(own[k], merged[k], atol=1e-4) for k in own)  # and REPAIR did change the merge
    with pytest.raises(ValueError, match="repair statistics 'both'"):
        repair_merge(model, merged, states, [{}] * 3, data, weights, CPU, "both")


class QueryFaults(InProcessGrid):
    """In-process nodes whose REPAIR queries fail (an error reply) for the partitions in ``failing``."""

    def __init__(self, values: dict, num_nodes: int, failing: set[int], first_node_id: int = 1000) -> None:
        super().__init__(build_client_app(values), num_nodes, first_node_id)
        self.failing = failing

    def deliver(self, message: Message) -> Message | None:
        partition = int(self.contexts[message.metadata.dst_node_id].node_config["partition-id"])
        config = message.content.config_records.get("config")
        asks = message.metadata.message_type == MessageType.QUERY and config is not None
        if asks and config.get(QUERY_KEY) == REPAIR_QUERY and partition in self.failing:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            error = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "RuntimeError: the statistics could not be taken")
            return Message(error, reply_to=message)
        return super().deliver(message)


def _run(tmp_path: Path, name: str, failing: set[int] = frozenset(), first_node_id: int = 1000, **changes) -> Path:
    values = {**RUN, "min-available-nodes": 3, "results-dir": str(tmp_path), "run-name": name, **changes}
    run_experiment(QueryFaults(values, 3, set(failing), first_node_id), parse_run_config(values))
    return tmp_path / name


def test_a_client_failing_the_query_is_dropped_with_its_reason_and_the_others_repair(tmp_path):
    rows = _rows(_run(tmp_path, "faulty", failing={1}))
    for row in rows[1:]:
        assert (row["repair"], row["repair-clients"], row["clients-trained"]) == ("on", 2, 3)
        assert list(row["repair-dropped-reasons"]) == ["1"]
        assert "the statistics could not be taken" in row["repair-dropped-reasons"]["1"]


def test_when_every_client_fails_the_query_the_round_keeps_the_unrepaired_merge(tmp_path):
    folder = _run(tmp_path, "failed", failing={0, 1, 2})
    plain = _run(tmp_path, "plain", repair="off")
    rows = _rows(folder)
    for row in rows[1:]:
        assert row["repair"] == "skipped: no client answered the REPAIR query of layer 'hidden.0'"
        assert sorted(row["repair-dropped-reasons"]) == ["0", "1", "2"]
    repair_keys = {"repair", "repair-dropped-reasons"}
    assert [{k: v for k, v in r.items() if k not in repair_keys} for r in rows] == _rows(plain)
    model, unrepaired = torch.load(folder / "model.pt"), torch.load(plain / "model.pt")
    assert all(torch.equal(model[k], unrepaired[k]) for k in model)


def test_a_run_resumed_between_two_repair_queries_goes_as_the_straight_run(tmp_path, monkeypatch):
    straight = _run(tmp_path, "straight")

    def stop_before_round_2_layer_2(folder, checkpoint):
        save_checkpoint(folder, checkpoint)
        pending = checkpoint.pending
        if pending is not None and (pending.server_round, pending.done) == (2, 2):
            raise KeyboardInterrupt("the server stops between two REPAIR queries of round 2")

    monkeypatch.setattr(server_app, "save_checkpoint", stop_before_round_2_layer_2)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "stopped")
    stopped = tmp_path / "stopped"
    checkpoint = load_checkpoint(stopped)
    assert checkpoint.round == 1 and checkpoint.pending is not None and checkpoint.pending.done == 2
    monkeypatch.setattr(server_app, "save_checkpoint", save_checkpoint)
    _run(tmp_path, "ignored", first_node_id=555, **{"resume-from": str(stopped)})  # other node ids, same partitions
    assert _rows(stopped) == _rows(straight)
    model, expected = torch.load(stopped / "model.pt"), torch.load(straight / "model.pt")
    assert all(torch.equal(model[k], expected[k]) for k in model)
    assert load_checkpoint(stopped).pending is None


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"strategy": "fedavg"}, ["'repair' = 'on'", "'fedavg' does not align", "'matched'", "'fedma'"]),
        ({"strategy": "fedprox"}, ["'repair' = 'on'", "'fedprox'", "repair=off"]),
        ({"model": "twonn", "bias": False}, ["'repair' = 'on'", "'twonn'", "layer 'hidden.0'", "without bias"]),
        ({"repair": "yes"}, ["'repair'", "'yes'", "'off'", "'on'"]),
    ],
)
def test_repair_is_refused_before_anything_starts(tmp_path, changes, named):
    values = {**RUN, **changes, "results-dir": str(tmp_path / "results")}
    with pytest.raises(ConfigError) as refused:
        check_run(parse_run_config(values))
    assert all(part in str(refused.value) for part in named), str(refused.value)
    assert not (tmp_path / "results").exists()


def test_every_aligning_strategy_repairs_its_merge(tmp_path):
    """FedMA repairs the group each stage matched (its output-layer stage none), HeteroFL's narrower clients only
    the units they hold, Ψ-Net's clients only the groups they train."""
    for name, changes in [
        ("otfusion", {"strategy": "otfusion"}),
        ("fedma", {"strategy": "fedma", "num-server-rounds": 5}),
        ("heterofl", {"strategy": "heterofl", "client-widths": "0.5,1"}),
        ("psinet", {"strategy": "psinet", "model": "psi-vgg9", "width-factor": 0.25, "num-server-rounds": 1}),
    ]:
        rows = _rows(_run(tmp_path, name, **changes))
        assert all(row["repair-std-change"] > 0 for row in rows[1:] if row["repair"] == "on"), name
        if name == "fedma":  # four hidden groups, one per stage, then the output layer
            assert [row.get("repair-layers") for row in rows[1:]] == [1, 1, 1, 1, None]
            assert rows[-1]["repair"] == "skipped: this round merged no hidden layer's units"
        else:
            assert all(row["repair"] == "on" for row in rows[1:]), name


@pytest.mark.long
def test_flowers_ray_simulation_repairs_as_the_in_process_engine(tmp_path):
    """Long (Ray's start-up): in CI, REPAIR's rounds are the same on the in-process and batched engines (above),
    and a Ray job's rows equal the in-process engine's (tests/test_sweep_runs.py, tests/test_ray_cluster.py)."""
    from flwr.simulation import run_simulation

    values = {**RUN, "min-available-nodes": 3, "results-dir": str(tmp_path)}
    run_in_process({**values, "run-name": "inprocess"}, 3)
    ray_values = {**values, "run-name": "ray"}
    run_simulation(
        server_app=server_app.build_server_app(ray_values),
        client_app=build_client_app(ray_values),
        num_supernodes=3,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "inprocess")
    assert _rows(tmp_path / "ray")[-1]["repair"] == "on"
