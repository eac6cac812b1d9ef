"""SuPerFed's client side: reduction to FedAvg, the loss terms, joint updates of both endpoints, the local model
kept in ``context.state`` and never sent, BatchNorm statistics re-estimated for mixed points; and two rounds of the
real apps in one process."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from alignfl.core.data import ClientData
from alignfl.fl_app.client_app import client_data
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.inprocess import run_in_process
from alignfl.strategies import get_strategy
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.superfed import (
    LOCAL_MODEL,
    SuPerFedUpdate,
    initial_local_model,
    layer_groups,
    start_round,
)
from tests.local_updates import (
    assert_same_state,
    config_of,
    data,
    fresh_model,
    make_context,
    received,
    run,
    superfed_config,
)


def test_registered_and_start_round_is_floor_of_fraction_times_rounds():
    assert get_strategy("superfed").client is SuPerFedUpdate
    assert start_round(superfed_config(superfed_start=0.5, num_server_rounds=5)) == 2
    assert start_round(superfed_config(superfed_start=0.0, num_server_rounds=5)) == 0


@pytest.mark.parametrize("mode", ["mm", "lm"])
def test_before_the_start_round_it_is_exactly_fedavg(mode):
    config = superfed_config(
        superfed_mode=mode, superfed_nu=0.0, superfed_mu=0.0, superfed_start=0.5, superfed_val_fraction=0.0
    )
    x, y = data()
    reference, personal = fresh_model(), fresh_model()
    run(LocalUpdate(config, make_context()), reference, x, y)
    update = SuPerFedUpdate(config, make_context(), received(1))  # round 1 < ⌊0.5·4⌋ = 2
    metrics = run(update, personal, x, y)
    assert metrics["superfed-mixing"] == 0
    assert_same_state(reference, personal)


def test_mixing_with_lambda_fixed_to_zero_is_exactly_fedavg_and_still_moves_the_local_model():
    config = superfed_config(
        superfed_mode="lm", superfed_nu=0.0, superfed_mu=0.0, superfed_start=0.5, superfed_val_fraction=0.0
    )
    x, y = data()
    reference, personal = fresh_model(), fresh_model()
    run(LocalUpdate(config, make_context()), reference, x, y)
    context = make_context()
    update = SuPerFedUpdate(config, context, received(3))
    update.draw_lambdas = lambda: [0.0] * len(update.groups)
    metrics = run(update, personal, x, y)
    assert metrics["superfed-mixing"] == 1
    assert_same_state(reference, personal)
    # w_l is in the optimizer (only weight decay acts on it with λ = 0) and was stored.
    assert metrics["superfed-local-norm-out"] != metrics["superfed-local-norm-in"]
    assert LOCAL_MODEL in context.state.array_records


def test_local_model_is_xavier_normal_seeded_by_partition():
    model = fresh_model()
    a, b, a2 = (initial_local_model(model, seed=0, partition_id=p) for p in (0, 1, 0))
    assert all(torch.equal(a[n], a2[n]) for n in a)
    assert not torch.equal(a["classifier.weight"], b["classifier.weight"])
    assert not torch.equal(a["classifier.weight"], dict(model.named_parameters())["classifier.weight"])
    weight = a["hidden.1.weight"]  # 100 × 20: Xavier-normal std = sqrt(2 / (fan_in + fan_out))
    assert weight.std().item() == pytest.approx(math.sqrt(2 / (20 + 100)), rel=0.1)
    assert torch.count_nonzero(a["hidden.1.bias"]) == 0


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.second = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def test_loss_terms_match_a_hand_computation_on_a_tiny_model():
    torch.manual_seed(0)
    model = Tiny()
    config = config_of(strategy="superfed", superfed_mode="lm", superfed_nu=2.0, superfed_mu=0.3, superfed_start=0.0)
    update = SuPerFedUpdate(config, make_context(), received(1))
    update.begin(model)
    assert layer_groups(model) == [["first.weight", "first.bias"], ["second.weight", "second.bias"]]
    with torch.no_grad():  # move w_f away from w_g so the proximal term is not zero
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    update.draw_lambdas = lambda: [0.25, 0.8]
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    loss = update.loss(model, x, y)

    f = {n: p.detach().double() for n, p in model.named_parameters()}
    g = {n: t.double() for n, t in update.global_params.items()}
    l = {n: t.detach().double() for n, t in update.local.items()}
    w1 = 0.75 * f["first.weight"] + 0.25 * l["first.weight"]
    b1 = 0.75 * f["first.bias"] + 0.25 * l["first.bias"]
    w2 = 0.2 * f["second.weight"] + 0.8 * l["second.weight"]
    b2 = 0.2 * f["second.bias"] + 0.8 * l["second.bias"]
    logits = torch.relu(x.double() @ w1.T + b1) @ w2.T + b2
    log_probs = logits - logits.logsumexp(dim=1, keepdim=True)
    ce = -log_probs[torch.arange(5), y].mean()
    prox = sum(
        math.sqrt(sum(((f[n] - g[n]) ** 2).sum().item() for n in layer))
        for layer in (["first.weight", "first.bias"], ["second.weight", "second.bias"])
    )
    fv, lv = torch.cat([t.flatten() for t in f.values()]), torch.cat([l[n].flatten() for n in f])
    cos = (fv @ lv).item() / (fv.norm().item() * lv.norm().item())
    assert loss.item() == pytest.approx(ce.item() + 0.3 * prox + 2.0 * cos**2, rel=1e-5)


def test_one_backward_pass_reaches_both_endpoints_and_one_step_moves_both():
    torch.manual_seed(0)
    model = Tiny()
    config = config_of(strategy="superfed", superfed_start=0.0, superfed_nu=1.0)
    update = SuPerFedUpdate(config, make_context(), received(1))
    update.begin(model)
    optimizer = update.optimizer(model)
    before_f = [p.detach().clone() for p in model.parameters()]
    before_l = [t.detach().clone() for t in update.local.values()]
    update.loss(model, torch.randn(6, 3), torch.randint(0, 2, (6,))).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in update.local.values())
    optimizer.step()
    assert all(not torch.equal(a, p) for a, p in zip(before_f, model.parameters()))
    assert all(not torch.equal(a, t) for a, t in zip(before_l, update.local.values()))


@pytest.mark.parametrize("mode", ["mm", "lm"])
def test_lambda_is_drawn_afresh_per_mini_batch_one_per_model_or_per_layer(mode):
    config = config_of(strategy="superfed", superfed_mode=mode, superfed_start=0.0)
    update = SuPerFedUpdate(config, make_context(), received(1))
    update.begin(Tiny())
    first, second = update.draw_lambdas(), update.draw_lambdas()
    assert len(first) == 2 and all(0.0 <= v < 1.0 for v in first + second)
    assert first != second
    assert (first[0] == first[1]) == (mode == "mm")


def test_local_model_persists_across_rounds_in_context_state_and_is_never_sent():
    config = superfed_config(superfed_start=0.0)
    context, x, y = make_context(), *data()
    model = fresh_model()
    first_update = SuPerFedUpdate(config, context, received(1))
    first = run(first_update, model, x, y)
    assert first_update.reply_records(ClientData(x, y, x, y)) == {}
    second = run(SuPerFedUpdate(config, context, received(2)), model, x, y)
    assert (first["superfed-local-rounds"], second["superfed-local-rounds"]) == (1, 2)
    assert second["superfed-local-norm-in"] == first["superfed-local-norm-out"] != first["superfed-local-norm-in"]
    # Another node (a fresh state) starts from the seeded initialisation again.
    other = run(SuPerFedUpdate(config, make_context(), received(2)), fresh_model(), x, y)
    assert other["superfed-local-norm-in"] == first["superfed-local-norm-in"]


def test_batchnorm_statistics_are_re_estimated_for_mixed_points_but_not_for_the_global_model():
    from alignfl.strategies.superfed import recalibrate_batchnorm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 10))
    x, y = data()
    recalibrate_batchnorm(model, x, torch.device("cpu"), batch_size=16)
    with torch.no_grad():
        features = model[1](model[0](x))
    assert torch.allclose(model[2].running_mean, features.mean(dim=0), atol=1e-5)
    # A plain average of the six batches' (unbiased) statistics, as BatchNorm's cumulative mode keeps them.
    batch_vars = torch.stack([chunk.var(dim=0) for chunk in features.split(16)])
    assert torch.allclose(model[2].running_var, batch_vars.mean(dim=0), atol=1e-5)
    assert model[2].momentum == 0.1  # restored

    config = config_of(strategy="superfed", superfed_start=0.0, superfed_val_fraction=0.25)
    model[2].reset_running_stats()  # the received global buffers: mean 0, var 1
    scores = SuPerFedUpdate(config, make_context(), received(1)).evaluate(
        model, ClientData(x, y, *data(40, 2)), torch.device("cpu")
    )
    plain = LocalUpdate(config, make_context()).evaluate(model, ClientData(x, y, *data(40, 2)), torch.device("cpu"))
    assert scores["lambda-accuracy"][0] == pytest.approx(plain["local-accuracy"])
    assert torch.count_nonzero(model[2].running_mean) == 0  # the received model itself is untouched


# --- the real apps in one process ---------------------------------------------------------------------------


def test_two_rounds_keep_each_local_model_across_rounds_and_report_personalised_accuracy(tmp_path):
    from alignfl.core.data import load_dataset
    from alignfl.core.model_io import build_run_model
    from alignfl.core.training.sgd import evaluate

    config = {
        "strategy": "superfed",
        "dataset": "digits",
        "model": "small-mlp",
        "num-server-rounds": 2,
        "superfed-start": 0.0,
        "results-dir": str(tmp_path),
        "partitioner": "iid",
        "holdout-clients": 1,
        "lr-decay": 0.9,
        "device": "cpu",
    }
    run_in_process(config, num_nodes=2)
    (folder,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    first, second = rows[1], rows[2]
    assert first["clients-trained"] == second["clients-trained"] == 1  # a reply with w_l in it would be dropped
    assert (first["superfed-local-rounds"], second["superfed-local-rounds"]) == (1, 2)
    assert second["superfed-local-norm-in"] == pytest.approx(first["superfed-local-norm-out"], rel=1e-12)
    assert second["superfed-local-norm-in"] != pytest.approx(first["superfed-local-norm-in"], rel=1e-6)
    summary = json.loads((folder / "summary.json").read_text())
    assert len(summary["final-lambda-accuracy-mean"]) == 11
    assert summary["final-superfed-local-trained-mean"] == 1.0
    assert summary["final-oracle-accuracy-mean"] >= summary["final-honest-accuracy-mean"]
    # partition 1 of 2 is a new client: never trained (above), scored with the global model every round
    assert all(row["new-clients-evaluated"] == 1 and row["clients-evaluated"] == 1 for row in rows[1:])
    assert summary["final-new-client-accuracy"] == rows[-1]["new-client-accuracy"]
    run_config = parse_run_config({**config, "min-available-nodes": 2})
    final = build_run_model(run_config, load_dataset("digits"))
    final.load_state_dict(torch.load(folder / "model.pt"))
    new_client = client_data(run_config, 1, 2)
    _, accuracy = evaluate(final, new_client.test_x, new_client.test_y, torch.device("cpu"))
    assert rows[-1]["new-client-accuracy"] == pytest.approx(accuracy)
