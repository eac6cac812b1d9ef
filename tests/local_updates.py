"""What the tests of client-side local updates share (SuPerFed, personalised evaluation, the personalised
baselines, learning-rate decay): a SuPerFed run config, a node's context, a received message, random data on the
8x8 digits' shape, a seeded small MLP, one local update run with a fixed seed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from alignfl.core.config import RunConfig
from alignfl.fl_app.config import parse_run_config
from alignfl.models import build_model
from alignfl.strategies.base import LocalUpdate

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
