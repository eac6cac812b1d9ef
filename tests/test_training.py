"""Device choice, batching and evaluation helpers shared by clients and server."""

import logging

import pytest
import torch
from torch import nn

from alignfl.core.training import sgd
from alignfl.core.training.sgd import evaluate, iterate_batches, round_generator, select_device


@pytest.fixture
def flwr_log(caplog):
    logger = logging.getLogger("flwr")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def test_auto_falls_back_to_cpu_and_says_so(monkeypatch, flwr_log):
    monkeypatch.setattr(sgd.torch.cuda, "is_available", lambda: False)
    assert select_device("auto") == torch.device("cpu")
    # a set: caplog sees the record through its own handler and through the root logger
    assert {(r.levelno, r.getMessage()) for r in flwr_log.records} == {
        (logging.INFO, "device=auto: CUDA is not available, training on CPU")
    }


def test_explicit_cuda_without_cuda_falls_back_with_a_warning(monkeypatch, flwr_log):
    monkeypatch.setattr(sgd.torch.cuda, "is_available", lambda: False)
    assert select_device("cuda:1") == torch.device("cpu")
    assert {(r.levelno, r.getMessage()) for r in flwr_log.records} == {
        (logging.WARNING, "device=cuda:1 requested but CUDA is not available: falling back to CPU")
    }


def test_auto_takes_cuda_when_present(monkeypatch):
    monkeypatch.setattr(sgd.torch.cuda, "is_available", lambda: True)
    assert select_device("auto") == torch.device("cuda")


def test_batches_cover_every_example_once_and_shuffle_reproducibly():
    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    first = torch.cat([yb for _, yb in iterate_batches(x, y, 3, round_generator(0, 1, 2))])
    again = torch.cat([yb for _, yb in iterate_batches(x, y, 3, round_generator(0, 1, 2))])
    other = torch.cat([yb for _, yb in iterate_batches(x, y, 3, round_generator(0, 2, 2))])
    assert sorted(first.tolist()) == list(range(10))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert [len(yb) for _, yb in iterate_batches(x, y, 3)] == [3, 3, 3, 1]


def test_evaluate_reports_loss_and_accuracy():
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1, 1])  # the third is wrong
    loss, accuracy = evaluate(model, x, y, torch.device("cpu"))
    assert accuracy == 0.75
    expected = nn.functional.cross_entropy(x, y).item()
    assert loss == pytest.approx(expected)


def _train(make_optimizer, device: torch.device, steps: int = 6) -> list[torch.Tensor]:
    """A small net trained a few steps with the optimizer ``make_optimizer`` builds; one layer stays frozen
    after the first step (no gradient: the optimizer must leave it and its momentum alone)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).to(device)
    optimizer = make_optimizer(model.parameters())
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(8, 5, generator=data).to(device), torch.randint(0, 3, (8,), generator=data).to(device)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if step >= 1:
            model[0].weight.grad = None
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.0, 1e-2), (0.9, 1e-4)])
def test_plain_sgd_takes_torchs_sgd_steps_bit_for_bit(momentum, weight_decay):
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        ours = _train(lambda p: sgd.PlainSGD(p, 0.1, momentum, weight_decay), device)
        torchs = _train(lambda p: torch.optim.SGD(p, lr=0.1, momentum=momentum, weight_decay=weight_decay), device)
        exact = device.type == "cpu"  # on CUDA torch takes its batched path: the same formula, rounding may differ
        for a, b in zip(ours, torchs):
            assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-6)
        one_step = _train(lambda p: sgd.PlainSGD(p, 0.1, momentum, weight_decay), device, steps=1)
        assert torch.equal(ours[0], one_step[0])  # the layer without gradients stayed where step 1 left it
        assert not torch.equal(ours[-1], one_step[-1])  # the others went on moving


def test_plain_sgd_does_not_import_torch_dynamo():
    import subprocess
    import sys

    code = (
        "import sys, torch; from alignfl.core.training.sgd import PlainSGD; m = torch.nn.Linear(2, 2); "
        "o = PlainSGD(m.parameters(), 0.1, 0.9, 1e-4); m(torch.ones(1, 2)).sum().backward(); o.step(); "
        "print('torch._dynamo' in sys.modules)"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )
