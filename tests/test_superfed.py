"""SuPerFed: reduction to FedAvg, the loss terms, joint updates, local-model persistence, personalised
evaluation with calibration, and label noise."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from torch import nn

from core.calibration import calibration_errors
from core.config import RunConfig
from core.label_noise import noisy_labels
from core.rounds import MetricAggregation, RoundRunner
from fl_app.client_app import build_client_app, client_data
from fl_app.config import ConfigError, build_context, parse_run_config
from fl_app.inprocess import InProcessGrid, run_in_process
from fl_app.results import RoundRecorder
from models import build_model
from strategies import get_strategy
from strategies.base import LocalUpdate
from strategies.superfed import (
    LAMBDA_GRID,
    LOCAL_MODEL,
    SuPerFedUpdate,
    initial_local_model,
    layer_groups,
    start_round,
)

SETTINGS = dict(
    strategy="superfed",
    dataset="digits",
    model="small-mlp",
    num_server_rounds=4,
    local_epochs=2,
    batch_size=16,
    lr=0.05,
    momentum=0.9,
    weight_decay=1e-4,
)


def config_of(**fields: Any) -> RunConfig:
    """A checked run config from field names (``superfed_mu`` is the run-config key ``superfed-mu``)."""
    return parse_run_config({name.replace("_", "-"): value for name, value in fields.items()})


def superfed_config(**fields: Any) -> RunConfig:
    """:data:`SETTINGS` with ``fields`` changed."""
    return config_of(**{**SETTINGS, **fields})


def make_context(partition_id: int = 0) -> SimpleNamespace:
    """What an update reads from Flower's Context: the node's partition and the persistent state."""
    return SimpleNamespace(state=RecordDict(), node_config={"partition-id": partition_id, "num-partitions": 3})


def received(server_round: int) -> RecordDict:
    return RecordDict({"config": ConfigRecord({"server-round": server_round})})


def data(n: int = 96, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def fresh_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("small-mlp", (1, 8, 8), 10)


def run(update: LocalUpdate, model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int = 7) -> dict:
    torch.manual_seed(seed)
    return update.train(model, x, y, torch.Generator().manual_seed(seed), torch.device("cpu"))


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(ta, tb), name


# --- 1. client side ------------------------------------------------------------------------------------------


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
    assert first_update.reply_records() == {}
    second = run(SuPerFedUpdate(config, context, received(2)), model, x, y)
    assert (first["superfed-local-rounds"], second["superfed-local-rounds"]) == (1, 2)
    assert second["superfed-local-norm-in"] == first["superfed-local-norm-out"] != first["superfed-local-norm-in"]
    # Another node (a fresh state) starts from the seeded initialisation again.
    other = run(SuPerFedUpdate(config, make_context(), received(2)), fresh_model(), x, y)
    assert other["superfed-local-norm-in"] == first["superfed-local-norm-in"]


# --- 2. personalised evaluation -----------------------------------------------------------------------------


def test_calibration_errors_match_a_hand_computed_case():
    probabilities = torch.tensor([[0.95, 0.05], [0.95, 0.05], [0.40, 0.60], [0.30, 0.70]])
    labels = torch.tensor([0, 1, 1, 0])
    # Bin (0.933, 1]: conf .95, .95, acc 1/2 → gap .45; bin (0.533, 0.6]: conf .6, acc 1 → gap .4;
    # bin (0.667, 0.733]: conf .7, acc 0 → gap .7.
    ece, mce = calibration_errors(probabilities, labels)
    assert ece == pytest.approx(0.5 * 0.45 + 0.25 * 0.4 + 0.25 * 0.7)
    assert mce == pytest.approx(0.7)
    assert all(math.isnan(v) for v in calibration_errors(torch.empty(0, 2), torch.empty(0, dtype=torch.long)))


def test_personalised_evaluation_scores_the_lambda_grid_with_oracle_and_honest_choices():
    config = superfed_config(superfed_start=0.0, superfed_val_fraction=0.25)
    context, (x, y), (tx, ty) = make_context(), data(), data(40, seed=2)
    model = fresh_model()
    update = SuPerFedUpdate(config, context, received(1))
    untrained = update.evaluate(model, x, y, tx, ty, torch.device("cpu"))
    assert untrained["superfed-local-trained"] == 0
    run(update, model, x, y)
    scores = SuPerFedUpdate(config, context, received(2)).evaluate(model, x, y, tx, ty, torch.device("cpu"))
    assert scores["superfed-local-trained"] == 1
    assert len(scores["lambda-accuracy"]) == len(scores["lambda-ece"]) == len(LAMBDA_GRID) == 11
    plain = LocalUpdate(config, context).evaluate(model, x, y, tx, ty, torch.device("cpu"))
    assert scores["local-accuracy"] == scores["lambda-accuracy"][0] == pytest.approx(plain["local-accuracy"])
    assert scores["local-ece"] == pytest.approx(plain["local-ece"]) and 0.0 <= plain["local-mce"] <= 1.0
    assert scores["oracle-accuracy"] == max(scores["lambda-accuracy"]) >= scores["honest-accuracy"]
    assert scores["oracle-lambda"] in LAMBDA_GRID and scores["honest-lambda"] in LAMBDA_GRID
    honest = LAMBDA_GRID.index(scores["honest-lambda"])
    assert scores["honest-ece"] == scores["lambda-ece"][honest]
    MetricRecord(scores)  # every value is a type a reply can carry


def test_recorder_keeps_extra_client_metrics_as_unweighted_means_and_in_the_summary(tmp_path):
    recorder = RoundRecorder(tmp_path, lambda arrays: (0.0, 0.5))
    replies = [
        RecordDict(
            {
                "metrics": MetricRecord(
                    {
                        "num-examples": n,
                        "partition-id": i,
                        "local-accuracy": acc,
                        "lambda-accuracy": grid,
                        "oracle-accuracy": acc + 0.1,
                    }
                )
            }
        )
        for i, (n, acc, grid) in enumerate([(10, 0.5, [0.5, 1.0]), (30, 0.7, [0.1, 0.2])])
    ]
    recorder.aggregate_evaluate(replies, "num-examples")
    recorder.evaluate(1, None)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["lambda-accuracy-mean"] == pytest.approx([0.3, 0.6])
    assert row["oracle-accuracy-mean"] == pytest.approx(0.7)
    summary = recorder.summary()
    assert summary["final-lambda-accuracy-mean"] == pytest.approx([0.3, 0.6])
    assert "final-local-accuracy-mean" in summary and "final-local-loss-mean" not in summary


# --- 3. label noise -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pair", "symmetric"])
def test_label_noise_flips_exactly_the_rate_by_its_rule_deterministically(kind):
    labels = torch.arange(200) % 10
    noisy = noisy_labels(labels, 10, kind, 0.4, seed=3, partition_id=1)
    flipped = noisy != labels
    assert int(flipped.sum()) == 80
    if kind == "pair":
        assert torch.equal(noisy[flipped], (labels[flipped] + 1) % 10)
    else:
        assert len(set(((noisy[flipped] - labels[flipped]) % 10).tolist())) > 3  # spread over other classes
    assert torch.equal(noisy, noisy_labels(labels, 10, kind, 0.4, seed=3, partition_id=1))
    assert not torch.equal(noisy, noisy_labels(labels, 10, kind, 0.4, seed=3, partition_id=2))
    assert torch.equal(noisy_labels(labels, 10, "none", 0.4, 3, 1), labels)


def test_label_noise_reaches_training_labels_only():
    clean = client_data(RunConfig(dataset="digits", partitioner="iid"), 0, 3)
    noisy = client_data(
        RunConfig(dataset="digits", partitioner="iid", label_noise="symmetric", label_noise_rate=0.2), 0, 3
    )
    assert torch.equal(clean.test_y, noisy.test_y) and torch.equal(clean.train_x, noisy.train_x)
    assert int((clean.train_y != noisy.train_y).sum()) == round(0.2 * len(clean.train_y))


def test_config_refuses_bad_superfed_and_noise_values():
    for key, value in [
        ("superfed-mode", "xx"),
        ("superfed-nu", -1.0),
        ("superfed-start", 1.5),
        ("superfed-val-fraction", 1.0),
        ("label-noise", "flip"),
        ("label-noise-rate", 1.0),
    ]:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            parse_run_config({key: value})


# --- new (held-out) clients and learning-rate decay ---------------------------------------------------------


def test_config_refuses_bad_holdout_and_lr_decay_values():
    for values in [
        {"holdout-clients": -1},
        {"holdout-clients": 2, "min-available-nodes": 2},
        {"lr-decay": 0.0},
        {"lr-decay": 1.5},
        {"lr-decay": math.nan},
    ]:
        key = next(k for k in values if k != "min-available-nodes")
        with pytest.raises(ConfigError, match=f"'{key}'"):
            parse_run_config(values)
    assert parse_run_config({"holdout-clients": 1, "min-available-nodes": 2}).holdout_clients == 1


class _RecordingGrid(InProcessGrid):
    """Six in-process nodes holding partitions 0..5 of 6: they answer the server's partition query and note
    every other message they get, by its type and their partition, without answering it."""

    def __init__(self) -> None:
        super().__init__(build_client_app(), num_nodes=6)
        self.received: list[tuple[str, int]] = []

    def deliver(self, message: Message) -> Message | None:
        if message.metadata.message_type == MessageType.QUERY:
            return super().deliver(message)
        partition = int(self.contexts[message.metadata.dst_node_id].node_config["partition-id"])
        self.received.append((message.metadata.message_type, partition))
        return None


@pytest.mark.parametrize("strategy", ["fedavg", "superfed", "scaffold"])
def test_held_out_partitions_are_never_sampled_for_training_but_are_evaluated(strategy):
    fold = lambda records, key: MetricRecord()  # noqa: E731
    config = config_of(strategy=strategy, dataset="digits", model="small-mlp", holdout_clients=2, min_available_nodes=6)
    server = get_strategy(strategy).server(build_context(config, fresh_model()))
    grid = _RecordingGrid()
    runner = RoundRunner(server, grid, MetricAggregation(fold, fold))
    arrays = server.context.initial_arrays
    assert runner.train_round(1, arrays) is arrays  # nobody answers: the global model stays
    runner.evaluate_round(1, arrays)
    trained = sorted(partition for kind, partition in grid.received if kind == MessageType.TRAIN)
    evaluated = sorted(partition for kind, partition in grid.received if kind == MessageType.EVALUATE)
    assert trained == [0, 1, 2, 3]  # partitions 4 and 5 of 6 are the new clients
    assert evaluated == [0, 1, 2, 3, 4, 5]


def test_recorder_scores_new_clients_apart_from_the_trained_ones(tmp_path):
    recorder = RoundRecorder(tmp_path, lambda arrays: (0.0, 0.5))
    trained = [
        RecordDict(
            {
                "metrics": MetricRecord(
                    {
                        "num-examples": 10,
                        "partition-id": i,
                        "local-accuracy": acc,
                        "local-ece": 0.1,
                        "lambda-accuracy": [acc, acc],
                        "new-client": 0,
                    }
                )
            }
        )
        for i, acc in enumerate([0.9, 0.7])
    ]
    new = [
        RecordDict(
            {
                "metrics": MetricRecord(
                    {
                        "num-examples": n,
                        "partition-id": 2 + i,
                        "local-accuracy": acc,
                        "local-ece": ece,
                        "local-mce": 0.3,
                        "new-client": 1,
                    }
                )
            }
        )
        for i, (n, acc, ece) in enumerate([(10, 0.2, 0.4), (30, 0.4, 0.2)])
    ]
    recorder.aggregate_evaluate(trained + new, "num-examples")
    recorder.evaluate(1, None)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["clients-evaluated"] == 2 and row["new-clients-evaluated"] == 2
    assert row["local-accuracy-mean"] == pytest.approx(0.8) and row["lambda-accuracy-mean"] == pytest.approx([0.8, 0.8])
    assert row["new-client-accuracy"] == pytest.approx(0.3)  # mean over new clients, not weighted by examples
    assert (row["new-client-ece"], row["new-client-mce"]) == (pytest.approx(0.3), pytest.approx(0.3))
    assert recorder.summary()["final-new-client-accuracy"] == pytest.approx(0.3)
    assert "new-client-mean" not in row  # a flag, not a score


def test_learning_rate_decays_per_round_and_needs_the_round():
    config = superfed_config(lr_decay=0.5)
    assert LocalUpdate(config, make_context(), received(3)).learning_rate() == pytest.approx(0.05 * 0.25)
    assert LocalUpdate(config.replace(lr_decay=1.0), make_context()).learning_rate() == 0.05
    with pytest.raises(ValueError, match="server-round"):
        LocalUpdate(config, make_context()).learning_rate()


def test_a_decayed_round_trains_exactly_like_the_decayed_learning_rate():
    x, y = data()
    decayed, plain = fresh_model(), fresh_model()
    run(LocalUpdate(superfed_config(lr_decay=0.9), make_context(), received(4)), decayed, x, y)
    run(LocalUpdate(superfed_config(lr=0.05 * 0.9**3), make_context(), received(4)), plain, x, y)
    assert_same_state(decayed, plain)


def test_every_optimizer_override_uses_the_decayed_learning_rate():
    from strategies.ditto import _PersonalStep
    from strategies.psinet import PsiNetUpdate

    config = superfed_config(lr_decay=0.5, superfed_start=0.0)
    expected = 0.05 * 0.5**2
    superfed = SuPerFedUpdate(config, make_context(), received(3))
    model = fresh_model()
    superfed.begin(model)
    psinet = PsiNetUpdate(config, make_context(), received(3))
    psinet._keys = [name for name, _ in model.named_parameters()]
    for optimizer in (
        superfed.optimizer(model),
        psinet.optimizer(model),
        _PersonalStep(config, [], received(3)).optimizer(model),
    ):
        assert optimizer.lr == pytest.approx(expected)


# --- the real apps in one process ---------------------------------------------------------------------------


def test_two_rounds_keep_each_local_model_across_rounds_and_report_personalised_accuracy(tmp_path):
    from core.data import load_dataset
    from core.model_io import build_run_model
    from core.training import evaluate

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


# --- 4. personalised baselines ------------------------------------------------------------------------------


def test_fedper_keeps_its_head_and_sends_only_the_body_trained():
    from strategies.fedper import PERSONAL_HEAD, FedPerUpdate

    config = superfed_config(strategy="fedper")
    context, (x, y), (tx, ty) = make_context(), data(), data(40, seed=2)
    model = fresh_model()
    received_state = {k: v.clone() for k, v in model.state_dict().items()}
    update = FedPerUpdate(config, context, received(1))
    assert update.evaluate(model, x, y, tx, ty, torch.device("cpu"))["personal-trained"] == 0
    run(update, model, x, y)
    sent = model.state_dict()
    assert torch.equal(sent["classifier.weight"], received_state["classifier.weight"])  # head not sent
    assert not torch.equal(sent["hidden.0.weight"], received_state["hidden.0.weight"])  # body trained
    head = context.state[PERSONAL_HEAD].to_torch_state_dict()
    assert not torch.equal(head["classifier.weight"], received_state["classifier.weight"])
    second = FedPerUpdate(config, context, received(2))
    second.begin(model)  # the next round trains under the kept head
    assert torch.equal(model.state_dict()["classifier.weight"], head["classifier.weight"])
    scores = FedPerUpdate(config, context, received(2)).evaluate(fresh_model(), x, y, tx, ty, torch.device("cpu"))
    assert scores["personal-trained"] == 1 and 0.0 <= scores["personal-accuracy"] <= 1.0


def test_ditto_sends_fedavgs_update_and_keeps_a_personal_model_pulled_to_the_global_one():
    from strategies.ditto import PERSONAL_MODEL, DittoUpdate, _PersonalStep

    config = superfed_config(strategy="ditto", ditto_lambda=0.5)
    context, (x, y) = make_context(), data()
    reference, model = fresh_model(), fresh_model()
    anchor = [p.detach().clone() for p in model.parameters()]
    run(LocalUpdate(config, make_context()), reference, x, y)
    run(DittoUpdate(config, context, received(1)), model, x, y)
    assert_same_state(reference, model)  # the global update is FedAvg's
    personal = context.state[PERSONAL_MODEL].to_torch_state_dict()
    assert not torch.equal(personal["hidden.0.weight"], model.state_dict()["hidden.0.weight"])

    probe = fresh_model(5)
    step = _PersonalStep(config, anchor)
    xb, yb = x[:8], y[:8]
    distance = sum((p - a).pow(2).sum() for p, a in zip(probe.parameters(), anchor))
    expected = nn.functional.cross_entropy(probe(xb), yb) + 0.25 * distance
    assert step.loss(probe, xb, yb).item() == pytest.approx(expected.item(), rel=1e-6)


def test_batchnorm_statistics_are_re_estimated_for_mixed_points_but_not_for_the_global_model():
    from strategies.superfed import recalibrate_batchnorm

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
        model, x, y, *data(40, 2), torch.device("cpu")
    )
    plain = LocalUpdate(config, make_context()).evaluate(model, x, y, *data(40, 2), torch.device("cpu"))
    assert scores["lambda-accuracy"][0] == pytest.approx(plain["local-accuracy"])
    assert torch.count_nonzero(model[2].running_mean) == 0  # the received model itself is untouched
