"""The authors' settings as keys: bias-free TwoNN/TwoCNN, the TwoNN's depth, lr warm-up, uniform server weighting,
SuPerFed's local-model initialisation and its figures without a validation split."""

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from alignfl.core.data import ClientData
from alignfl.core.rounds.strategy import Reply, weighted_mean
from alignfl.fl_app.config import parse_run_config
from alignfl.models import build_model, permute_state, random_permutations
from alignfl.strategies.base import LocalUpdate
from alignfl.strategies.superfed import SuPerFedUpdate, initial_local_model


@pytest.mark.parametrize(
    ("name", "options"), [("twonn", {"bias": False, "hidden_layers": 3}), ("twocnn", {"bias": False})]
)
def test_bias_free_nets_have_no_bias_and_keep_their_symmetry(name, options):
    model = build_model(name, (1, 28, 28), 10, **options).eval()
    assert not [key for key in model.state_dict() if key.endswith("bias")]
    state = model.state_dict()
    spec = model.permutation_spec()
    permuted = build_model(name, (1, 28, 28), 10, **options).eval()
    permuted.load_state_dict(
        permute_state(spec, state, random_permutations(spec, state, torch.Generator().manual_seed(1)))
    )
    x = torch.randn(4, 1, 28, 28)
    torch.testing.assert_close(permuted(x), model(x))


def test_the_authors_twonn_is_784_200_200_200():
    model = build_model("twonn", (1, 28, 28), 10, bias=False, hidden_layers=3)
    assert [tuple(layer.weight.shape) for layer in model.hidden] == [(200, 784), (200, 200), (200, 200)]
    assert [tuple(layer.weight.shape) for layer in build_model("twonn", (1, 28, 28), 10).hidden] == [
        (200, 784),
        (200, 200),
    ]


def _lr(config, server_round: int) -> float:
    received = RecordDict({"config": ConfigRecord({"server-round": server_round})})
    return LocalUpdate(config, None, received).learning_rate()


def test_lr_warms_up_linearly_then_decays():
    config = parse_run_config({"lr": 0.1, "lr-warmup-rounds": 4})
    assert [_lr(config, r) for r in (1, 2, 4, 9)] == pytest.approx([0.025, 0.05, 0.1, 0.1])
    both = parse_run_config({"lr": 0.1, "lr-warmup-rounds": 2, "lr-decay": 0.5})
    assert [_lr(both, r) for r in (1, 2, 3)] == pytest.approx([0.05, 0.05, 0.025])
    assert LocalUpdate(parse_run_config({"lr": 0.1}), None).learning_rate() == 0.1  # no round needed


def _reply(value: float, examples: int, weight: float) -> Reply:
    content = RecordDict(
        {"arrays": ArrayRecord({"w": torch.full((2,), value)}), "metrics": MetricRecord({"num-examples": examples})}
    )
    return Reply(1, 0, content, weight)


def test_uniform_weighting_takes_the_plain_mean():
    weighted = weighted_mean([_reply(0.0, 1, 1.0), _reply(4.0, 3, 3.0)])
    uniform = weighted_mean([_reply(0.0, 1, 1.0), _reply(4.0, 3, 1.0)])
    assert weighted["w"].numpy().tolist() == [3.0, 3.0] and uniform["w"].numpy().tolist() == [2.0, 2.0]


def test_the_authors_local_init_depends_on_the_client_only():
    model = build_model("twonn", (1, 28, 28), 10, bias=False, hidden_layers=3)
    first = initial_local_model(model, seed=0, partition_id=3, init="authors")
    assert all(torch.equal(first[k], v) for k, v in initial_local_model(model, 7, 3, "authors").items())
    assert not torch.equal(first["hidden.0.weight"], initial_local_model(model, 0, 4, "authors")["hidden.0.weight"])
    expected = torch.empty(200, 200)
    torch.nn.init.xavier_normal_(expected, generator=torch.Generator().manual_seed(3))  # every layer restarts it
    assert torch.equal(first["hidden.2.weight"], expected)
    seeded = initial_local_model(model, 7, 3, "seeded")
    assert not torch.equal(seeded["hidden.0.weight"], initial_local_model(model, 0, 3, "seeded")["hidden.0.weight"])


def test_without_a_validation_split_no_honest_figures_are_reported():
    config = parse_run_config({"strategy": "superfed", "superfed-val-fraction": 0.0, "dataset": "digits"})
    model = build_model("mlp", (1, 8, 8), 10)
    context = type("Ctx", (), {"state": RecordDict(), "node_config": {"partition-id": 0}})()
    x, y = torch.randn(20, 1, 8, 8), torch.randint(0, 10, (20,))
    scores = SuPerFedUpdate(config, context).evaluate(model, ClientData(x, y, x, y), torch.device("cpu"))
    assert "oracle-accuracy" in scores and not [key for key in scores if key.startswith("honest")]
