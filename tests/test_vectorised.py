"""Stacked (vectorised) local updates equal the sequential ones: float64 to 1e-9 for one round of every
algorithm that vectorises (clients of unequal sizes, momentum, weight decay, BatchNorm, PANs), float32 within
0.2 accuracy points per round over whole runs."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MessageType, RecordDict

from alignfl.core.data import ClientData, load_dataset
from alignfl.core.model_io import build_run_model, load_arrays
from alignfl.core.training import vectorised
from alignfl.core.training.sgd import PlainSGD, round_generator
from alignfl.core.training.vectorised import ClientSteps, StackedTrainer, unsupported
from alignfl.fl_app.client_app import TrainJob, finish_train
from alignfl.fl_app.config import build_context, parse_run_config
from alignfl.fl_app.engines.batched import run_batched
from alignfl.fl_app.engines.grid import vectorise_choice
from alignfl.fl_app.engines.worker import stack_start, stacks_of, train_stacked
from alignfl.fl_app.inprocess import set_task_identity
from alignfl.models.cnn import PlainConvNet
from alignfl.models.mlp import MLP
from alignfl.models.pan import PanSettings
from alignfl.strategies import get_strategy, list_strategies
from alignfl.strategies.base import LocalUpdate

VECTORISED = [name for name in list_strategies() if get_strategy(name).client.not_vectorised is None]
SIZES = (37, 16, 5, 50)
"""Training examples per client: with batch 16, last batches of 5, 16, 5 and 2 examples, and a one-batch client."""
BATCHED = "batched products, at most 316 clients a stack (32 MiB of parameters)"
MODELS = {
    "pan-mlp": {"model": "small-mlp", "pan-mode": "mul", "pan-a": 0.2, "pan-t": 1.0},  # batched products
    "batchnorm": {"model": "vgg9-bn", "width-factor": 0.125},
}


class _Nodes:
    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def trainable(self) -> list[int]:
        return self.nodes


def _values(strategy: str, model: str) -> dict:
    return {
        "strategy": strategy,
        **MODELS[model],
        "dataset": "digits",
        "device": "cpu",
        "batch-size": 16,
        "local-epochs": 2,
        "momentum": 0.9,
        "weight-decay": 1e-3,
        "lr": 0.05,
        "seed": 3,
    }


def _round(config, model, contexts, content, server_round, data, stacked: bool) -> list[Message]:
    """One training round of every client, each as the ClientApp runs it, sequentially or stacked."""
    jobs, starts = [], []
    for partition, (context, (x, y)) in enumerate(zip(contexts, data, strict=True)):
        message = Message(copy.deepcopy(content), dst_node_id=partition + 1, message_type=MessageType.TRAIN)
        message.metadata.__dict__["_message_id"] = f"m{partition}"
        load_arrays(model, message.content["arrays"])
        generator = round_generator(config.seed, server_round, partition)
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
        update = get_strategy(config.strategy).client(config, context, message.content)
        job = TrainJob(
            message,
            context,
            config,
            partition,
            ClientData(x, y, x[:0], y[:0]),
            model,
            torch.device("cpu"),
            generator,
            update,
        )
        if stacked:
            jobs.append(job)
            starts.append(stack_start(job))
        else:
            jobs.append(finish_train(job, update.train(model, x, y, generator, job.device)))
    return train_stacked(jobs, starts, data) if stacked else jobs


def _content(config, model, strategy_name: str, server_round: int, nodes: list[int], noise: int) -> RecordDict:
    """The training message the algorithm's server sends, with any extra record made non-zero."""
    context = build_context(config, model)
    strategy = get_strategy(strategy_name).server(context)
    arrays = context.initial_arrays
    record = {**config.pan_signature(), "server-round": server_round}
    from flwr.app import ConfigRecord

    planned = strategy.plan_train(server_round, arrays, ConfigRecord(record), lambda: nodes, _Nodes(nodes))
    content = planned[nodes[0]]
    generator = torch.Generator().manual_seed(noise)
    for name in list(content.array_records):
        if name != "arrays":  # e.g. SCAFFOLD's control variate: zero in a first round, made non-trivial here
            content[name] = ArrayRecord(
                {
                    k: Array((torch.randn(a.shape, generator=generator, dtype=torch.float64) * 0.01).numpy())
                    for k, a in content[name].items()
                }
            )
    return content


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("model_kind", list(MODELS))
@pytest.mark.parametrize("strategy", VECTORISED)
def test_a_stacked_round_equals_the_sequential_one_in_float64(strategy, model_kind):
    set_task_identity()
    config = parse_run_config(_values(strategy, model_kind))
    dataset = load_dataset("digits")
    torch.manual_seed(0)
    model = build_run_model(config, dataset).double()
    assert unsupported(model) is None
    offsets = torch.tensor((0, *SIZES)).cumsum(0).tolist()
    data = [(dataset.train_x[a:b].double(), dataset.train_y[a:b]) for a, b in zip(offsets, offsets[1:], strict=False)]
    nodes = list(range(1, len(SIZES) + 1))
    contexts = [
        Context(1, node, {"partition-id": p, "num-partitions": len(SIZES)}, RecordDict(), {})
        for p, node in enumerate(nodes)
    ]
    # Round 1 (sequential) leaves each client its state (SCAFFOLD's c_i, FedPer's head); round 2 is compared.
    first = _content(config, model.float().double(), strategy, 1, nodes, noise=1)
    _round(config, model, contexts, first, 1, data, stacked=False)
    second = _content(config, model, strategy, 2, nodes, noise=2)
    twin = copy.deepcopy(contexts)
    sequential = _round(config, model, contexts, second, 2, data, stacked=False)
    stacked = _round(config, model, twin, second, 2, data, stacked=True)

    for one, other, context, context_twin in zip(sequential, stacked, contexts, twin, strict=True):
        assert not one.has_error() and not other.has_error(), (one, other)
        assert set(one.content.array_records) == set(other.content.array_records)
        for name, record in one.content.array_records.items():
            for key, array in record.items():
                expected = torch.from_numpy(array.numpy())
                got = torch.from_numpy(other.content[name][key].numpy())
                if expected.is_floating_point():
                    assert expected.dtype == torch.float64 and _relative(got, expected) <= 1e-9, (name, key)
                else:  # FedMA's class counts
                    assert torch.equal(got, expected), (name, key)
        metrics, metrics_stacked = one.content["metrics"], other.content["metrics"]
        assert set(metrics) == set(metrics_stacked)
        for key, value in metrics.items():
            assert metrics_stacked[key] == pytest.approx(value, rel=1e-9), key
        for key, record in context.state.array_records.items():
            for name, array in record.items():
                got = torch.from_numpy(context_twin.state[key][name].numpy())
                assert _relative(got, torch.from_numpy(array.numpy())) <= 1e-9, (key, name)


def test_the_stacked_update_steps_each_client_through_exactly_its_own_batches():
    """A client's stacked result does not depend on the other clients in the stack (sizes, batches)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model.double()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(20, 3, dtype=torch.float64), torch.randint(0, 2, (20,))
    alone = StackedTrainer(model, [start], 0.1, 0.9, 0.01).run(
        [ClientSteps(x[:7], y[:7], [torch.arange(4), torch.arange(4, 7)])]
    )
    batches = [torch.arange(4), torch.arange(4, 7)]
    other = ClientSteps(x[7:], y[7:], [torch.arange(5), torch.arange(5, 10), torch.arange(10, 13)])
    together = StackedTrainer(model, [start, start], 0.1, 0.9, 0.01).run([ClientSteps(x[:7], y[:7], batches), other])
    assert together.steps(0) == 2 and together.steps(1) == 3
    for key, value in alone.states[0].items():
        assert torch.allclose(together.states[0][key].double(), value.double(), rtol=1e-12, atol=1e-12), key
    assert together.losses[0] == pytest.approx(alone.losses[0], rel=1e-12)


def test_an_mlp_steps_through_its_stacked_forward_each_client_exactly_its_own_batches(monkeypatch):
    """The MLPs' path (batched products, short batches padded with weight 0, finished clients dropped) gives
    each client its sequential update, whatever the other clients in the stack; other models, and stacks over
    the size limit, use ``vmap``."""
    torch.manual_seed(2)
    model = MLP((1, 4, 3), 4, (5, 3), PanSettings(mode="mul", amplitude=0.3)).double()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(30, 1, 4, 3, dtype=torch.float64), torch.randint(0, 4, (30,))
    plans = [
        (slice(0, 7), [torch.arange(4), torch.arange(4, 7), torch.tensor([6, 0, 2, 1]), torch.tensor([3, 5, 4])]),
        (slice(7, 9), [torch.arange(2)]),
        (slice(9, 30), [torch.arange(4), torch.arange(4, 8), torch.arange(8, 9)]),
    ]
    clients = [ClientSteps(x[rows], y[rows], batches) for rows, batches in plans]
    trainer = StackedTrainer(model, [start] * 3, 0.1, 0.9, 0.01)
    assert trainer.forward is not None
    together = trainer.run(clients)
    for index, client in enumerate(clients):
        model.load_state_dict(start)
        optimizer = PlainSGD(model.parameters(), 0.1, 0.9, 0.01)
        losses = []
        for batch in client.batches:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(client.x[batch]), client.y[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert together.steps(index) == len(client.batches)
        assert together.losses[index] == pytest.approx(losses, rel=1e-12)
        for key, value in model.state_dict().items():
            assert torch.allclose(together.states[index][key], value, rtol=1e-12, atol=1e-12), (index, key)

    class Reversed(MLP):
        def forward(self, x):
            return super().forward(x.flip(-1))

    bn = PlainConvNet((1, 4, 3), 4, (2,), (), 3, PanSettings(), norm="bn")
    for other in (Reversed((1, 4, 3), 4, (5,), PanSettings()), bn):
        assert StackedTrainer(other, [other.state_dict()] * 2, 0.1).forward is None
    size = vectorised.parameter_bytes(model)
    monkeypatch.setattr(vectorised, "STACKED_FORWARD_BYTES", 8 * size)  # the size limit is the workers' to keep
    assert StackedTrainer(model, [start] * 9, 0.1).forward is not None


def test_a_round_of_more_clients_than_fit_one_stack_trains_as_several_stacks_of_equal_size(monkeypatch):
    """On a CPU, clients of a model with a stacked forward pass beyond :data:`STACKED_FORWARD_BYTES` train as
    several stacks that each fit, as equal in size as can be, every client in one of them; on CUDA, and under
    ``vmap``, as one stack of any size."""
    model = MLP((1, 4, 3), 4, (5, 3), PanSettings())
    size = vectorised.parameter_bytes(model)
    monkeypatch.setattr(vectorised, "STACKED_FORWARD_BYTES", 8 * size + size // 2)
    assert vectorised.clients_per_stack(model, cuda=False) == 8
    members = [(index, SimpleNamespace(model=model), {}) for index in range(17)]
    stacks = stacks_of(members)
    assert sorted(len(stack) for stack in stacks) == [5, 6, 6]
    assert sorted(index for stack in stacks for index, _, _ in stack) == list(range(17))
    monkeypatch.setattr(vectorised, "STACKED_FORWARD_BYTES", 4 * size)
    assert sorted(len(stack) for stack in stacks_of(members)) == [3, 3, 3, 4, 4]
    assert vectorised.clients_per_stack(model, cuda=True) is None
    bn = PlainConvNet((1, 4, 3), 4, (2,), (), 3, PanSettings(), norm="bn")  # vmap: one stack of any size
    assert vectorised.clients_per_stack(bn, cuda=False) is None
    assert stacks_of([(index, SimpleNamespace(model=bn), {}) for index in range(5)]) == [
        [(index, SimpleNamespace(model=bn), {}) for index in range(5)]
    ]


def test_every_strategy_says_whether_it_vectorises_and_why_not():
    for name in list_strategies():
        client = get_strategy(name).client
        assert client.not_vectorised is None or client.not_vectorised.strip(), name
    assert {"fedavg", "fedprox", "fedavgm", "scaffold"} <= set(VECTORISED)
    assert "superfed" not in VECTORISED and "moon" not in VECTORISED

    class Custom(LocalUpdate):
        def loss(self, model, x, y):
            return super().loss(model, x, y)

    assert "overrides loss" in Custom.not_vectorised


def test_vectorise_on_is_refused_by_what_cannot_vectorise_and_off_turns_it_off():
    config = parse_run_config({"dataset": "digits", "model": "small-mlp", "strategy": "moon"})
    for setting in ("on", "auto"):
        stacked, reason = vectorise_choice(config, setting, gpu_workers=True)
        assert stacked is False and reason.startswith("strategy moon: ")
    fedavg = config.replace(strategy="fedavg")
    assert vectorise_choice(fedavg, "on")[0] is True and vectorise_choice(fedavg, "off") == (
        False,
        "sim.vectorise=off",
    )
    with pytest.raises(
        ValueError, match=r"sim.vectorise = 'yes' is not allowed: choose one of \['auto', 'on', 'off'\]"
    ):
        vectorise_choice(fedavg, "yes")


def test_vectorise_auto_stacks_only_where_clients_train_on_cuda(monkeypatch):
    fedavg = parse_run_config({"dataset": "digits", "model": "small-mlp", "device": "auto"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    stacked, reason = vectorise_choice(fedavg, "auto")
    assert stacked is False and reason.startswith("device cpu: auto stacks on CUDA only")
    assert "sim.vectorise=on forces them" in reason
    assert vectorise_choice(fedavg, "on") == (
        True,
        f"fedavg on small-mlp vectorises ({BATCHED}); sim.vectorise=on",
    )
    assert vectorise_choice(fedavg, "auto", gpu_workers=True)[0] is True  # Ray workers given a GPU share
    assert vectorise_choice(fedavg.replace(device="cuda"), "auto")[0] is False  # no CUDA here: select_device's CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vectorise_choice(fedavg, "auto") == (
        True,
        "fedavg on small-mlp vectorises (batched products) and trains on CUDA",
    )
    assert vectorise_choice(fedavg.replace(device="cpu"), "auto", gpu_workers=True)[0] is False


def test_vectorise_on_trains_models_too_large_for_stacks_of_eight_one_after_another_on_a_cpu(monkeypatch):
    """Where fewer than MIN_CLIENTS_PER_STACK copies fit STACKED_FORWARD_BYTES, a CPU trains clients one after
    another even with ``on`` (stacks were slower there); CUDA still stacks them."""
    wide = parse_run_config({"dataset": "fashion-mnist", "model": "mlp", "device": "auto"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    stacked, reason = vectorise_choice(wide, "on")
    assert stacked is False
    assert reason == (
        "model mlp: its 11.1 MiB of parameters leave fewer than 8 clients a 32 MiB stack, and on a CPU such "
        "stacks were slower than one client after another (benchmarks/stacked_step.py)"
    )
    assert vectorise_choice(wide.replace(model="twonn"), "on")[0] is True  # 0.76 MiB: stacks of 42
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vectorise_choice(wide, "on") == (True, "fedavg on mlp vectorises (batched products); sim.vectorise=on")


def test_a_run_with_vectorise_auto_on_a_cpu_trains_one_after_another(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = _count_stacked(monkeypatch)
    values = {"dataset": "digits", "model": "small-mlp", "num-server-rounds": 1, "results-dir": str(tmp_path)}
    run_batched({**values, "run-name": "auto"}, 3, "auto")
    assert calls == []
    run_batched({**values, "run-name": "on"}, 3, "on")
    assert len(calls) == 1


def _count_stacked(monkeypatch) -> list[int]:
    """Each stacked update the batched engine's workers train, by its number of clients."""
    from alignfl.fl_app.engines import worker

    calls: list[int] = []
    original = worker.train_stacked

    def counted(jobs, *args, **kwargs):
        calls.append(len(jobs))
        return original(jobs, *args, **kwargs)

    monkeypatch.setattr(worker, "train_stacked", counted)
    return calls


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold"])
def test_float32_stacked_runs_stay_within_0_2_accuracy_points_of_sequential_ones(strategy, tmp_path, monkeypatch):
    values = {
        "strategy": strategy,
        "dataset": "digits",
        "model": "twonn",
        "pan-mode": "add",
        "pan-a": 0.1,
        "num-server-rounds": 4,
        "batch-size": 10,
        "momentum": 0.5,
        "partitioner": "dirichlet",
        "results-dir": str(tmp_path),
        "device": "cpu",
    }
    rows = {}
    calls = _count_stacked(monkeypatch)
    for vectorise in ("off", "on"):
        run_batched({**values, "run-name": vectorise}, 8, vectorise)
        lines = (tmp_path / vectorise / "metrics.jsonl").read_text().splitlines()
        rows[vectorise] = [json.loads(line) for line in lines]
    assert len(calls) == 4 and all(count > 1 for count in calls)  # "on": one stacked update a round
    assert len(rows["off"]) == len(rows["on"]) == 5
    for one, other in zip(rows["off"], rows["on"], strict=True):
        assert abs(one["accuracy"] - other["accuracy"]) <= 0.002, (one["round"], one["accuracy"], other["accuracy"])
        assert one.get("clients-trained") == other.get("clients-trained")
    assert Path(tmp_path / "on" / "summary.json").exists()


@pytest.mark.parametrize("model_kind", list(MODELS))
def test_a_fedma_stage_trains_stacked_as_one_after_another_freezing_the_same_entries(model_kind):
    """At a later FedMA stage every client freezes the entries matched so far and retrains the rest for
    fedma-retrain-epochs: stacked, the same entries stay as received and the others equal the sequential ones."""
    from alignfl.core.merging.layerwise import frozen_at
    from alignfl.models.protocol import head_of
    from alignfl.strategies.fedma import STAGE

    set_task_identity()
    config = parse_run_config({**_values("fedma", model_kind), "fedma-retrain-epochs": 1, "local-epochs": 3})
    dataset = load_dataset("digits")
    torch.manual_seed(0)
    model = build_run_model(config, dataset).double()
    offsets = torch.tensor((0, *SIZES)).cumsum(0).tolist()
    data = [(dataset.train_x[a:b].double(), dataset.train_y[a:b]) for a, b in zip(offsets, offsets[1:], strict=False)]
    nodes = list(range(1, len(SIZES) + 1))
    stage = 2
    content = _content(config, model, "fedma", 1, nodes, noise=1)
    content["config"][STAGE] = stage
    received = {k: torch.from_numpy(a.numpy()) for k, a in content["arrays"].items()}
    frozen = frozen_at(model.permutation_spec(), received, head_of(model).keys, stage)
    assert frozen and set(received) - frozen

    def replies(stacked: bool, run_config=config) -> list[Message]:
        contexts = [
            Context(1, node, {"partition-id": p, "num-partitions": len(SIZES)}, RecordDict(), {})
            for p, node in enumerate(nodes)
        ]
        return _round(run_config, model, contexts, content, 3, data, stacked=stacked)

    sequential, stacked = replies(False), replies(True)
    one_epoch = replies(True, parse_run_config({**_values("fedma", model_kind), "fedma-retrain-epochs": 1}))
    for one, other, again, (_, y) in zip(sequential, stacked, one_epoch, data, strict=True):
        assert not one.has_error() and not other.has_error(), (one, other)
        one_state, other_state = (
            {k: torch.from_numpy(a.numpy()) for k, a in reply.content["arrays"].items()} for reply in (one, other)
        )
        for key, expected in one_state.items():
            assert _relative(other_state[key], expected) <= 1e-9, key
            assert torch.equal(other_state[key], received[key]) == (key in frozen), key
        assert other.content["metrics"]["train-loss"] == pytest.approx(one.content["metrics"]["train-loss"], rel=1e-9)
        # fedma-retrain-epochs (1), not local-epochs (3 here, 2 there): the same result
        for key, array in other.content["arrays"].items():
            assert torch.equal(torch.from_numpy(array.numpy()), torch.from_numpy(again.content["arrays"][key].numpy()))
        counts = other.content["class-counts"]["counts"].numpy().tolist()
        assert counts == torch.bincount(y, minlength=10).tolist()
