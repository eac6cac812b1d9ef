"""The personalised baselines: FedPer keeps its head and sends the trained body; Ditto sends FedAvg's update and
keeps a personal model pulled towards the global one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from alignfl.core.data import ClientData
from alignfl.strategies.base import LocalUpdate
from tests.local_updates import assert_same_state, data, fresh_model, make_context, received, run, superfed_config


def test_fedper_keeps_its_head_and_sends_only_the_body_trained():
    from alignfl.strategies.fedper import PERSONAL_HEAD, FedPerUpdate

    config = superfed_config(strategy="fedper")
    context, (x, y), (tx, ty) = make_context(), data(), data(40, seed=2)
    model = fresh_model()
    received_state = {k: v.clone() for k, v in model.state_dict().items()}
    update = FedPerUpdate(config, context, received(1))
    assert update.evaluate(model, ClientData(x, y, tx, ty), torch.device("cpu"))["personal-trained"] == 0
    run(update, model, x, y)
    sent = model.state_dict()
    assert torch.equal(sent["classifier.weight"], received_state["classifier.weight"])  # head not sent
    assert not torch.equal(sent["hidden.0.weight"], received_state["hidden.0.weight"])  # body trained
    head = context.state[PERSONAL_HEAD].to_torch_state_dict()
    assert not torch.equal(head["classifier.weight"], received_state["classifier.weight"])
    second = FedPerUpdate(config, context, received(2))
    second.begin(model)  # the next round trains under the kept head
    assert torch.equal(model.state_dict()["classifier.weight"], head["classifier.weight"])
    scores = FedPerUpdate(config, context, received(2)).evaluate(
        fresh_model(), ClientData(x, y, tx, ty), torch.device("cpu")
    )
    assert scores["personal-trained"] == 1 and 0.0 <= scores["personal-accuracy"] <= 1.0


def test_ditto_sends_fedavgs_update_and_keeps_a_personal_model_pulled_to_the_global_one():
    from alignfl.strategies.ditto import PERSONAL_MODEL, DittoUpdate, _PersonalStep

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
