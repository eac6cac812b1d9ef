"""Device choice, batching and evaluation helpers shared by clients and server."""

import logging

import pytest
import torch
from torch import nn

from core import training
from core.training import evaluate, iterate_batches, round_generator, select_device


@pytest.fixture
def flwr_log(caplog):
    logger = logging.getLogger("flwr")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def test_auto_falls_back_to_cpu_and_says_so(monkeypatch, flwr_log):
    monkeypatch.setattr(training.torch.cuda, "is_available", lambda: False)
    assert select_device("auto") == torch.device("cpu")
    # a set: caplog sees the record through its own handler and through the root logger
    assert {(r.levelno, r.getMessage()) for r in flwr_log.records} == {
        (logging.INFO, "device=auto: CUDA is not available, training on CPU")}


def test_explicit_cuda_without_cuda_falls_back_with_a_warning(monkeypatch, flwr_log):
    monkeypatch.setattr(training.torch.cuda, "is_available", lambda: False)
    assert select_device("cuda:1") == torch.device("cpu")
    assert {(r.levelno, r.getMessage()) for r in flwr_log.records} == {
        (logging.WARNING, "device=cuda:1 requested but CUDA is not available: falling back to CPU")}


def test_auto_takes_cuda_when_present(monkeypatch):
    monkeypatch.setattr(training.torch.cuda, "is_available", lambda: True)
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
