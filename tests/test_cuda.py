"""The batched engine on a CUDA device (skipped where torch sees none; ``scripts/gpu_check.sh`` runs them): stacked
updates stay within 0.2 accuracy points of sequential ones, each worker keeps its clients' training data on the
device, and Ray workers share one GPU by fractions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from alignfl.fl_app.engines.batched import run_batched
from alignfl.fl_app.engines.worker import Worker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

VALUES = {
    "dataset": "digits",
    "model": "twocnn",
    "num-server-rounds": 3,
    "batch-size": 10,
    "partitioner": "dirichlet",
    "device": "auto",
    "tracking": "none",
}


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def full_float32() -> Iterator[None]:
    """Convolutions and matrix products in float32, not TF32 (PyTorch's default for convolutions on Ampere and
    later GPUs), put back afterwards."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


def test_stacked_updates_on_cuda_stay_within_0_2_accuracy_points(tmp_path, monkeypatch, full_float32):
    """In float32: TF32 rounds to about 1e-3 of a value, differently in a stacked call than in one client's, and
    on an H200 that moved the CNN's round-2 accuracy by 0.83 points; this pins the stacked update's arithmetic,
    not TF32's rounding."""
    kept: list[Worker] = []
    original = Worker.__init__

    def remember(self, *args, **kwargs):
        original(self, *args, **kwargs)
        kept.append(self)

    monkeypatch.setattr(Worker, "__init__", remember)
    for vectorise in ("off", "on"):
        run_batched({**VALUES, "results-dir": str(tmp_path), "run-name": vectorise}, 20, vectorise)
    for one, other in zip(_rows(tmp_path / "off"), _rows(tmp_path / "on"), strict=True):
        assert abs(one["accuracy"] - other["accuracy"]) <= 0.002
    on_device = [x for worker in kept for x, _ in worker._device_data.values()]
    assert on_device and all(x.is_cuda for x in on_device)


@pytest.mark.slow
def test_ray_workers_share_one_gpu_by_fractions(tmp_path):
    from alignfl.fl_app.engines.grid import RayOptions

    options = RayOptions(num_cpus=2, num_gpus=1, worker_gpus=0.5)
    run_batched({**VALUES, "results-dir": str(tmp_path), "run-name": "ray"}, 10, "auto", ray=options)
    run_batched({**VALUES, "results-dir": str(tmp_path), "run-name": "here"}, 10, "auto")
    for one, other in zip(_rows(tmp_path / "ray"), _rows(tmp_path / "here"), strict=True):
        assert abs(one["accuracy"] - other["accuracy"]) <= 0.002
