"""SCAFFOLD's control variates and MOON's contrastive loss: client math, server aggregation, state across rounds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from alignfl.core.config import RunConfig
from alignfl.core.data import ClientData
from alignfl.core.model_io import to_arrays
from alignfl.core.rounds.nodes import NodeDirectory
from alignfl.core.rounds.replies import reply_problem
from alignfl.core.rounds.strategy import Reply, RunContext
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.inprocess import run_in_process
from alignfl.models import build_model
from alignfl.models.protocol import ModelHead
from alignfl.strategies import get_strategy
from alignfl.strategies.moon import STATE_KEY as MOON_STATE
from alignfl.strategies.moon import MoonUpdate, contrastive_loss
from alignfl.strategies.scaffold import CONTROL, Scaffold, ScaffoldUpdate, momentum_step_sum
from alignfl.strategies.scaffold import STATE_KEY as SCAFFOLD_STATE

CPU = torch.device("cpu")


def _config(**fields: Any) -> RunConfig:
    """A run config from field names (``moon_mu`` is the run-config key ``moon-mu``)."""
    return parse_run_config({name.replace("_", "-"): value for name, value in fields.items()})


def _context(**state) -> SimpleNamespace:
    return SimpleNamespace(state=RecordDict(state))


def _tiny_model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _data(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=generator), torch.randint(0, 2, (n,), generator=generator)


def _record(values: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: v.detach().clone() for k, v in values.items()})


# --- SCAFFOLD client --------------------------------------------------------------------------


def test_momentum_step_sum_is_k_for_plain_sgd_and_counts_carried_steps():
    assert momentum_step_sum(5, 0.0) == 5.0
    assert momentum_step_sum(2, 0.5) == pytest.approx(1.0 + 1.5)  # step 1's gradient moves twice (1 + β)


def test_scaffold_client_corrects_gradients_and_updates_its_control_variate():
    """Plain SGD (the paper's setting): compare with a hand-written corrected SGD and option II."""
    model, (x, y) = _tiny_model(), _data()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    c = {"weight": torch.full((2, 3), 0.3), "bias": torch.tensor([-0.2, 0.1])}
    c_i = {"weight": torch.linspace(-0.5, 0.5, 6).reshape(2, 3), "bias": torch.tensor([0.4, 0.0])}
    lr, steps = 0.1, 3
    config = _config(strategy="scaffold", lr=lr, momentum=0.0, weight_decay=0.0, local_epochs=steps, batch_size=len(y))
    context = _context(**{SCAFFOLD_STATE: _record(c_i)})
    update = ScaffoldUpdate(config, context, RecordDict({"arrays": _record(start), CONTROL: _record(c)}))

    metrics = update.train(model, x, y, torch.Generator().manual_seed(0), CPU)

    # by hand: w ← w − η·(∇CE(w) + c − c_i), K times (one full batch per epoch)
    w = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    raw_gradients = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(x @ w["weight"].T + w["bias"], y)
        grads = dict(zip(w, torch.autograd.grad(loss, list(w.values()))))
        raw_gradients.append(grads)
        with torch.no_grad():
            for k in w:
                w[k] -= lr * (grads[k] + c[k] - c_i[k])
    for k in w:
        torch.testing.assert_close(model.state_dict()[k], w[k].detach())

    stored = context.state[SCAFFOLD_STATE].to_torch_state_dict()
    sent = update.reply_records(ClientData(x, y, x, y))[CONTROL].to_torch_state_dict()
    for k in w:
        expected = c_i[k] - c[k] + (start[k] - w[k].detach()) / (steps * lr)  # option II
        torch.testing.assert_close(stored[k], expected)
        torch.testing.assert_close(sent[k], expected - c_i[k])
        # option II with plain SGD is the mean of the uncorrected gradients along the way
        torch.testing.assert_close(stored[k], sum(g[k] for g in raw_gradients) / steps)
    assert metrics["local-steps"] == steps
    assert metrics["control-norm-start"] == pytest.approx(math.sqrt(sum((v**2).sum().item() for v in c_i.values())))


def test_scaffold_with_momentum_recovers_a_constant_gradient():
    """With momentum the weights travel further per step; dividing by momentum_step_sum, not K, keeps
    c_i⁺ the mean gradient (dividing by K would give about 1/(1−β) times it)."""

    class LinearObjective(ScaffoldUpdate):
        def loss(self, model, x, y):
            return (model(x) * torch.tensor([1.0, -2.0])).sum()

    model, (x, y) = _tiny_model(), _data()
    gradient = {"weight": torch.outer(torch.tensor([1.0, -2.0]), x.sum(0)), "bias": torch.tensor([1.0, -2.0]) * len(y)}
    c = {"weight": torch.full((2, 3), 0.5), "bias": torch.tensor([0.1, -0.1])}
    c_i = {"weight": torch.full((2, 3), -0.25), "bias": torch.tensor([0.3, 0.2])}
    config = _config(strategy="scaffold", lr=0.01, momentum=0.9, weight_decay=0.0, local_epochs=4, batch_size=len(y))
    context = _context(**{SCAFFOLD_STATE: _record(c_i)})
    update = LinearObjective(config, context, RecordDict({CONTROL: _record(c)}))
    update.train(model, x, y, torch.Generator().manual_seed(0), CPU)
    stored = context.state[SCAFFOLD_STATE].to_torch_state_dict()
    for k in gradient:
        torch.testing.assert_close(stored[k], gradient[k], rtol=1e-4, atol=1e-4)


def test_scaffold_first_round_starts_from_zero_and_keeps_buffers_at_zero():
    config = _config(strategy="scaffold", dataset="digits", model="resnet20", lr=0.05, local_epochs=1, batch_size=8)
    model = build_model("resnet20", (1, 8, 8), 10)
    zeros = ArrayRecord({k: torch.zeros_like(v) for k, v in to_arrays(model).to_torch_state_dict().items()})
    context = _context()
    update = ScaffoldUpdate(config, context, RecordDict({CONTROL: zeros}))
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    metrics = update.train(model, x, y, torch.Generator(), CPU)
    assert metrics["control-norm-start"] == 0.0 and metrics["control-norm-end"] > 0.0
    sent = update.reply_records(ClientData(x, y, x, y))[CONTROL]
    assert set(sent) == set(zeros)  # the same keys as the model: the server checks them against it
    assert not sent["stem_bn.running_mean"].numpy().any()  # statistics have no gradient: no control variate
    assert sent["stem_conv.weight"].numpy().any()


def test_scaffold_client_refuses_a_message_without_control():
    received = RecordDict({"config": ConfigRecord({"server-round": 1})})
    update = ScaffoldUpdate(_config(strategy="scaffold"), _context(), received)
    with pytest.raises(ValueError, match="no 'control' record.*strategy=scaffold"):
        update.begin(_tiny_model())


# --- SCAFFOLD server --------------------------------------------------------------------------

GLOBAL = {"w": np.zeros((2, 3), dtype=np.float32), "b": np.ones(2, dtype=np.float32)}


def _arrays(values: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in values.items()})


def _reply(model: dict, control: dict | None, examples: int, node: int) -> Reply:
    records = {"arrays": _arrays(model), "metrics": MetricRecord({"num-examples": examples})}
    if control is not None:
        records[CONTROL] = _arrays(control)
    return Reply(node, node, RecordDict(records), examples)


def _scaffold_server(**config: Any) -> Scaffold:
    run = _config(strategy="scaffold", **config)
    return get_strategy("scaffold").server(RunContext(run, _arrays(GLOBAL), None, ModelHead((), 2)))


class _Grid:
    """Four connected nodes that do not answer the partition query (so they sort by node id)."""

    def get_node_ids(self):
        return [11, 12, 13, 14]

    def send_and_receive(self, messages, timeout=None):
        return []


def test_scaffold_server_sends_zero_control_with_the_model(monkeypatch):
    for name in ("_run_id", "_task_id", "_node_id"):  # Flower stamps messages with the running task's ids
        monkeypatch.setattr(TaskIdentity, name, 1)
    strategy = _scaffold_server(min_available_nodes=4)
    nodes = NodeDirectory(_Grid(), holdout_clients=0)
    contents = strategy.plan_train(1, _arrays(GLOBAL), ConfigRecord(), nodes.trainable, nodes)
    assert sorted(contents) == [11, 12, 13, 14] and strategy.num_nodes == 4
    for content in contents.values():
        assert set(content.array_records) == {"arrays", CONTROL}
        control = content[CONTROL]
        assert set(control) == set(GLOBAL)
        assert all(not control[k].numpy().any() and control[k].shape == GLOBAL[k].shape for k in GLOBAL)


def test_scaffold_server_moves_c_by_the_mean_update_over_all_nodes_and_applies_server_lr():
    strategy = _scaffold_server(scaffold_server_lr=0.5)
    reference = _arrays(GLOBAL)
    strategy.control = _arrays({"w": np.full((2, 3), 1.0), "b": np.zeros(2)})
    strategy.num_nodes = 4
    usable = [
        _reply({"w": np.full((2, 3), 2.0), "b": np.ones(2)}, {"w": np.full((2, 3), 4.0), "b": np.ones(2)}, 1, 1),
        _reply({"w": np.full((2, 3), 6.0), "b": np.ones(2)}, {"w": np.full((2, 3), 8.0), "b": np.ones(2)}, 3, 2),
    ]
    no_control = _reply({"w": np.full((2, 3), 99.0), "b": np.ones(2)}, None, 5, 3)
    nan_control = _reply(
        {"w": np.full((2, 3), 99.0), "b": np.ones(2)}, {"w": np.full((2, 3), np.nan), "b": np.ones(2)}, 5, 4
    )
    assert all(strategy.reply_problem(reply.content, reference) is None for reply in usable)
    # the round runner drops these two: they never reach aggregate
    assert "got ['arrays']" in strategy.reply_problem(no_control.content, reference)
    assert "'control' holds NaN" in strategy.reply_problem(nan_control.content, reference)
    model = strategy.aggregate(1, usable, reference).arrays
    # ȳ = (1·2 + 3·6)/4 = 5; x + 0.5·(ȳ − x) = 2.5 (the control records are not averaged into the model)
    np.testing.assert_allclose(model["w"].numpy(), np.full((2, 3), 2.5))
    np.testing.assert_allclose(model["b"].numpy(), np.ones(2))
    # c + (|S|/N)·mean Δc_i = 1 + (2/4)·6 = 4
    np.testing.assert_allclose(strategy.control["w"].numpy(), np.full((2, 3), 4.0))
    np.testing.assert_allclose(strategy.control["b"].numpy(), np.full(2, 0.5))


def test_replies_name_their_array_records():
    reference = _arrays(GLOBAL)
    with_control = _reply(GLOBAL, GLOBAL, 2, 1).content
    assert reply_problem(with_control, reference, (CONTROL,)) is None
    assert "expected ArrayRecords ['arrays']" in reply_problem(with_control, reference)  # FedAvg expects the model only
    assert "got ['arrays']" in reply_problem(_reply(GLOBAL, None, 2, 1).content, reference, (CONTROL,))
    wrong_shape = _reply(GLOBAL, {"w": np.zeros((3, 2)), "b": np.ones(2)}, 2, 1).content
    assert "'control' has shape (3, 2)" in _scaffold_server().reply_problem(wrong_shape, reference)


# --- MOON -------------------------------------------------------------------------------------


def test_moon_loss_is_the_papers_formula_and_rewards_agreeing_with_the_global_model():
    generator = torch.Generator().manual_seed(0)
    z_glob, z_prev = torch.randn(5, 8, generator=generator), torch.randn(5, 8, generator=generator)
    z = torch.randn(5, 8, generator=generator)
    tau = 0.5

    def formula(z):
        positive = torch.exp(nn.functional.cosine_similarity(z, z_glob) / tau)
        negative = torch.exp(nn.functional.cosine_similarity(z, z_prev) / tau)
        return (-torch.log(positive / (positive + negative))).mean()

    torch.testing.assert_close(contrastive_loss(z, z_glob, z_prev, tau), formula(z))
    near_global = z_glob + 0.1 * torch.randn(5, 8, generator=generator)
    near_previous = z_prev + 0.1 * torch.randn(5, 8, generator=generator)
    assert (
        contrastive_loss(near_global, z_glob, z_prev, tau)
        < math.log(2)
        < contrastive_loss(near_previous, z_glob, z_prev, tau)
    )


def test_moon_update_adds_mu_times_the_contrastive_term_once_a_previous_model_exists():
    torch.manual_seed(0)
    model, previous = build_model("small-mlp", (1, 8, 8), 10), build_model("small-mlp", (1, 8, 8), 10)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    config = _config(strategy="moon", moon_mu=2.0, moon_tau=0.5)
    cross_entropy = nn.functional.cross_entropy(model(x), y)

    first = MoonUpdate(config, _context())
    first.begin(model)
    torch.testing.assert_close(first.loss(model, x, y), cross_entropy)  # no previous model yet: CE alone

    later = MoonUpdate(config, _context(**{MOON_STATE: to_arrays(previous)}))
    later.begin(model)
    with torch.no_grad():
        model.classifier.bias.add_(1.0)  # the model trains away from the global copy taken in begin()
        model.hidden[0].weight.mul_(1.5)
    expected = nn.functional.cross_entropy(model(x), y) + 2.0 * contrastive_loss(
        model.representation(x), first.global_model.representation(x), previous.representation(x), 0.5
    )
    torch.testing.assert_close(later.loss(model, x, y), expected)


def test_moon_keeps_the_trained_model_for_the_next_round():
    model = build_model("small-mlp", (1, 8, 8), 10)
    context = _context()
    metrics = MoonUpdate(_config(strategy="moon", batch_size=4), context).train(
        model, torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)), torch.Generator().manual_seed(0), CPU
    )
    assert metrics["has-previous-model"] == 0.0 and metrics["contrastive-loss"] == 0.0
    stored = context.state[MOON_STATE].to_torch_state_dict()
    for key, value in to_arrays(model).to_torch_state_dict().items():
        assert torch.equal(stored[key], value)


# --- two rounds of the real apps in one process (a few seconds each) ---------------------------
# PANs are on here (pan-mode="mul", pan-a=0.1) so that these runs also show that both algorithms run with PAN
# models; with PANs off the client and server code is the same, and the tests above use plain models.


def _two_rounds(results: Path, strategy: str) -> list[dict]:
    config = {
        "dataset": "digits",
        "num-server-rounds": 2,
        "partitioner": "iid",
        "strategy": strategy,
        "pan-mode": "mul",
        "pan-a": 0.1,
        "results-dir": str(results),
        "device": "cpu",
    }
    run_in_process(config, num_nodes=3)
    (folder,) = results.iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2] and rows[2]["clients-trained"] == 3
    assert rows[2]["accuracy"] > 0.5  # chance is 0.1; FedAvg reaches ~0.78 here
    return rows


def test_scaffold_control_variates_survive_between_rounds(tmp_path):
    rows = _two_rounds(tmp_path, "scaffold")
    assert rows[1]["control-norm-start"] == 0.0  # nothing stored before round 1
    assert rows[2]["control-norm-start"] > 0.0  # round 2 starts from the c_i each client wrote in round 1
    assert rows[2]["control-norm-start"] == pytest.approx(rows[1]["control-norm-end"])


def test_moon_previous_model_survives_between_rounds(tmp_path):
    rows = _two_rounds(tmp_path, "moon")
    assert rows[1]["has-previous-model"] == 0.0 and rows[1]["contrastive-loss"] == 0.0
    assert rows[2]["has-previous-model"] == 1.0 and rows[2]["contrastive-loss"] > 0.0
