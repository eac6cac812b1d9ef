"""The batched engine's Grid: a round's messages go to long-lived workers at once, not one by one.

:class:`BatchedGrid` keeps every simulated node's ``Context`` (its partition in ``node_config``, its ``state``
across rounds), gives messages ids as Flower's grids do, and hands each ``send_and_receive`` call's messages
to a :class:`WorkerPool` in one call: :class:`InProcessPool` (one :class:`alignfl.fl_app.engines.worker.Worker` in this
process) or :class:`alignfl.fl_app.engines.ray_workers.RayWorkerPool` (long-lived Ray actors, on this machine or a
cluster). The ServerApp's round runner, strategies, metrics, checkpoints and resume are the ones every other
engine runs (:func:`alignfl.fl_app.server_app.run_experiment`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import Any, Protocol

from flwr.app import Message
from flwr.common.logger import log

from alignfl.core.config import RunConfig
from alignfl.core.data import dataset_info
from alignfl.core.model_io import build_model_for
from alignfl.core.training.sgd import select_device
from alignfl.core.training.vectorised import (
    MIN_CLIENTS_PER_STACK,
    STACKED_FORWARD_BYTES,
    parameter_bytes,
    pays_on_cpu,
    stacked_method,
    unsupported,
)
from alignfl.fl_app.config import ConfigError
from alignfl.fl_app.engines.worker import Job, Worker
from alignfl.fl_app.inprocess import FIRST_NODE_ID, give_message_id, node_contexts, set_task_identity
from alignfl.strategies import get_strategy

VECTORISE_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class RayOptions:
    """Where the actors run and what each holds: ``address`` of a running cluster (None: a Ray of this process's
    own, capped at ``num_cpus``/``num_gpus`` when given), resources per actor, and how many actors (None: as many
    as the cluster's CPUs, and GPUs if asked for, hold)."""

    address: str | None = None
    num_cpus: int | None = None
    num_gpus: float | None = None
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0
    num_workers: int | None = None


class WorkerPool(Protocol):
    """Runs a batch of (message, node context) pairs; a reply per pair, or None where none came in time."""

    def run(self, jobs: Sequence[Job], timeout: float | None) -> list[Message | None]: ...

    def close(self) -> None: ...


class InProcessPool:
    """One worker in this process: the messages run one after another (or stacked), contexts updated in place.
    Nothing interrupts a message here, so ``round-timeout`` drops no client (as on the in-process engine)."""

    def __init__(self, overrides: Mapping[str, Any], vectorise: bool) -> None:
        self.worker = Worker(overrides, vectorise)

    def run(self, jobs: Sequence[Job], timeout: float | None) -> list[Message | None]:
        return list(self.worker.run(jobs))

    def close(self) -> None:
        """Nothing to release: the worker goes with this object."""


def vectorise_choice(config: RunConfig, setting: str, gpu_workers: bool = False) -> tuple[bool, str]:
    """Whether training messages train stacked, and why (one line for the log).

    ``sim.vectorise``: ``on`` = wherever the algorithm's local update and the model allow it, on a CPU only for
    models small enough that stacks of several clients fit (:func:`alignfl.core.training.vectorised.pays_on_cpu`;
    larger ones train one after another, which was faster there); ``auto`` = there and only where the clients also
    train on CUDA (``device`` as :func:`alignfl.core.training.sgd.select_device` resolves it here, or Ray workers
    given a GPU share, ``gpu_workers``), so CPU runs keep the sequential update's float32 results (a stacked update
    differs by rounding), although on a CPU it is faster for the small MLPs (``benchmarks/client_throughput.py``);
    ``off`` = never.
    """
    if setting not in VECTORISE_CHOICES:
        raise ConfigError(f"sim.vectorise = {setting!r} is not allowed: choose one of {list(VECTORISE_CHOICES)}")
    if setting == "off":
        return False, "sim.vectorise=off"
    reason = get_strategy(config.strategy).client.not_vectorised
    if reason is not None:
        return False, f"strategy {config.strategy}: {reason}"
    shape, classes = dataset_info(config.dataset)
    model = build_model_for(config, shape, classes)
    reason = unsupported(model)
    if reason is not None:
        return False, f"model {config.model}: {reason}"
    cuda = config.device != "cpu" and (gpu_workers or select_device(config.device).type == "cuda")
    if not cuda and not pays_on_cpu(model):
        return False, (
            f"model {config.model}: its {parameter_bytes(model) / 2**20:.1f} MiB of parameters leave fewer than "
            f"{MIN_CLIENTS_PER_STACK} clients a {STACKED_FORWARD_BYTES // 2**20} MiB stack, and on a CPU such stacks "
            "were slower than one client after another (benchmarks/stacked_step.py)"
        )
    allowed = f"{config.strategy} on {config.model} vectorises ({stacked_method(model, cuda)})"
    if setting == "on":
        return True, f"{allowed}; sim.vectorise=on"
    if not cuda:
        return False, (
            "device cpu: auto stacks on CUDA only, so CPU runs keep the sequential update's float32 results "
            "(stacked ones differ by rounding; benchmarks/client_throughput.py times both); sim.vectorise=on forces them"
        )
    return True, f"{allowed} and trains on CUDA"


class BatchedGrid:
    """A Grid of ``num_nodes`` simulated nodes whose messages run on ``pool`` a round at a time (replies come
    back in sending order; a message without a reply is one its worker did not answer in time, or lost)."""

    def __init__(self, pool: WorkerPool, num_nodes: int, first_node_id: int = FIRST_NODE_ID) -> None:
        set_task_identity()
        self.pool = pool
        self.contexts = node_contexts(num_nodes, first_node_id)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        jobs = []
        for message in messages:
            give_message_id(message)
            jobs.append((message, self.contexts[message.metadata.dst_node_id]))
        return [reply for reply in self.pool.run(jobs, timeout) if reply is not None]


def describe_choice(vectorise: bool, reason: str) -> None:
    """Say once in the log how the batched engine trains clients."""
    how = "stacked, many clients at once" if vectorise else "one client after another"
    log(INFO, "[alignfl] batched engine: client updates %s (%s)", how, reason)
