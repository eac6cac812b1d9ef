"""The batched engine's workers as long-lived Ray actors: on this machine, or on a running Ray cluster.

Each actor is one :class:`fl_app.engines.worker.Worker` with ``client-cpus`` CPUs and ``client-gpus`` GPUs (a
fraction shares a GPU between actors; each actor then keeps one CUDA context and its clients' training data on
the device). A round's messages are cut into one contiguous share per actor, sent with their nodes' contexts,
and come back as replies and the nodes' new ``context.state``; the contexts stay with the grid, so any actor can
run any node. An actor that does not answer within the round's timeout is stopped (its messages get no reply:
the round runner drops them as late); an actor lost with its node fails its messages with a reason naming the
node, leaves the pool, and later rounds run on the others.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import ray
from flwr.app import Message, RecordDict
from flwr.common.logger import log

from fl_app.engines.grid import RayOptions
from fl_app.engines.worker import Job, Worker
from fl_app.inprocess import flower_error


@ray.remote
class WorkerActor:
    """One worker in a Ray actor."""

    def __init__(self, overrides: Mapping[str, Any], vectorise: bool, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.worker = Worker(overrides, vectorise)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, jobs: Sequence[Job]) -> list[tuple[Message, RecordDict]]:
        replies = self.worker.run(jobs)
        return [(reply, context.state) for reply, (_, context) in zip(replies, jobs, strict=True)]


def _start_ray(options: RayOptions) -> bool:
    """Start or join Ray unless this process already has; returns whether this call did (then it shuts it down).
    The actors import the project as this process does (its ``sys.path`` as their ``PYTHONPATH``)."""
    if ray.is_initialized():
        return False
    pythonpath = os.pathsep.join(p for p in sys.path if p)
    args: dict[str, Any] = {"include_dashboard": False, "runtime_env": {"env_vars": {"PYTHONPATH": pythonpath}}}
    if options.address is not None:
        args["address"] = options.address
    else:
        args.update(
            {k: v for k, v in (("num_cpus", options.num_cpus), ("num_gpus", options.num_gpus)) if v is not None}
        )
    ray.init(**args)
    return True


def pool_size(options: RayOptions, resources: Mapping[str, float]) -> int:
    """How many actors: ``num_workers``, or as many as the cluster's resources hold (at least one)."""
    if options.num_workers is not None:
        return options.num_workers
    count = int(resources.get("CPU", 1.0) // options.worker_cpus)
    if options.worker_gpus > 0:
        count = min(count, int(resources.get("GPU", 0.0) // options.worker_gpus))
    return max(count, 1)


class RayWorkerPool:
    """Long-lived worker actors; :meth:`run` spreads a batch of messages over them and waits for all."""

    def __init__(self, overrides: Mapping[str, Any], vectorise: bool, options: RayOptions) -> None:
        self.started_ray = _start_ray(options)
        count = pool_size(options, ray.cluster_resources())
        threads = max(int(options.worker_cpus), 1)
        spec = WorkerActor.options(
            num_cpus=options.worker_cpus, num_gpus=options.worker_gpus, scheduling_strategy="SPREAD"
        )
        self.actors = [spec.remote(dict(overrides), vectorise, threads) for _ in range(count)]
        self.nodes = dict(zip(self.actors, ray.get([actor.node_id.remote() for actor in self.actors]), strict=True))
        log(INFO, "[alignfl] batched engine: %d Ray worker(s) on %d node(s)", count, len(set(self.nodes.values())))

    def run(self, jobs: Sequence[Job], timeout: float | None) -> list[Message | None]:
        replies: list[Message | None] = [None] * len(jobs)
        if not self.actors:
            return [flower_error(message, "every Ray worker of the batched engine was lost") for message, _ in jobs]
        shares = _shares(len(jobs), len(self.actors))
        calls = {}
        for actor, (start, stop) in zip(self.actors, shares, strict=False):
            if stop > start:
                calls[actor.run.remote(list(jobs[start:stop]))] = (actor, start, stop)
        done, late = ray.wait(list(calls), num_returns=len(calls), timeout=timeout)
        for ref in done:
            actor, start, stop = calls[ref]
            try:
                results = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                node = self.nodes.pop(actor)
                self._lose(actor, f"the batched engine's worker on Ray node {node} was lost: {error}")
                reason = f"the worker on Ray node {node} was lost ({type(error).__name__})"
                for index in range(start, stop):
                    message = jobs[index][0]
                    replies[index] = flower_error(message, reason, "NODE_UNAVAILABLE")
                continue
            for index, (reply, state) in zip(range(start, stop), results, strict=True):
                jobs[index][1].state = state
                replies[index] = reply
        for ref in late:
            actor, _, _ = calls[ref]
            self._lose(actor, f"a worker on Ray node {self.nodes.pop(actor)} did not answer in time; stopped")
            ray.kill(actor)
        return replies

    def _lose(self, actor: Any, why: str) -> None:
        log(WARNING, "[alignfl] %s; %d worker(s) left", why, len(self.actors) - 1)
        self.actors.remove(actor)

    def close(self) -> None:
        """Stop the actors, and Ray if this pool started it."""
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.started_ray:
            ray.shutdown()


def _shares(count: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous (start, stop) shares of ``count`` messages over ``workers``, as equal as can be."""
    base, extra = divmod(count, workers)
    bounds = [0]
    for index in range(workers):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    return list(zip(bounds, bounds[1:], strict=False))
