"""The batched engine's workers as long-lived Ray actors: on this machine, or on a running Ray cluster.

Each actor is one :class:`alignfl.fl_app.engines.worker.Worker` with ``client-cpus`` CPUs and ``client-gpus`` GPUs (a
fraction shares a GPU between actors; each actor then keeps one CUDA context and its clients' training data on
the device). A round's messages are cut into one contiguous share per actor, sent with their nodes' contexts,
and come back as replies and the nodes' new ``context.state``; the contexts stay with the grid, so any actor can
run any node. An actor that dies before it is placed (Ray still lists a node that was just lost, and places one
there) or is not placed within :data:`PLACEMENT_TIMEOUT_S` is left out of the pool before round 0, and the run
goes on on the others. An actor that does not answer within the round's timeout is stopped (its messages get no
reply: the round runner drops them as late); an actor lost with its node fails its messages with a reason naming
the node (its id and address), leaves the pool, and later rounds run on the others.
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

from alignfl.fl_app.engines.grid import RayOptions
from alignfl.fl_app.engines.worker import Job, Worker
from alignfl.fl_app.inprocess import flower_error

PLACEMENT_TIMEOUT_S = 120.0
"""Seconds the pool waits for its actors to be placed and started (their imports take seconds): one still
pending then (no live node has room for it) is stopped and left out, instead of being waited for for ever."""


@ray.remote
class WorkerActor:
    """One worker in a Ray actor."""

    def __init__(self, overrides: Mapping[str, Any], vectorise: bool, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.worker = Worker(overrides, vectorise)

    def placement(self) -> dict[str, str]:
        """The Ray node this actor runs on (``node-id``, ``address``)."""
        return {"node-id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address()}

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
        actors = [spec.remote(dict(overrides), vectorise, threads) for _ in range(count)]
        self.nodes = place(actors, PLACEMENT_TIMEOUT_S)  # each actor of the pool → "<node id> (<address>)"
        self.actors = list(self.nodes)
        workers, nodes = len(self.actors), len(set(self.nodes.values()))
        log(INFO, "[alignfl] batched engine: %d Ray worker(s) on %d node(s)", workers, nodes)

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


def place(actors: Sequence[Any], timeout_s: float) -> dict[Any, str]:
    """Each actor that Ray placed and started within ``timeout_s`` → its node, ``<id> (<address>)``. One that
    died first (e.g. placed on a node Ray had not yet noticed was lost) or is still pending is stopped and left
    out, with a warning, and the pool goes on with the others; when none is left, a RuntimeError with the reason."""
    calls = {actor.placement.remote(): actor for actor in actors}
    done, pending = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
    placed: dict[Any, str] = {}
    reasons = []
    for ref in done:
        try:
            node = ray.get(ref)
        except ray.exceptions.RayActorError as error:
            said = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())  # names node and ip
            reasons.append(f"died before it was placed ({type(error).__name__}: {said})")
            continue
        placed[calls[ref]] = f"{node['node-id']} ({node['address']})"
    reasons += [f"was not placed within {timeout_s:.0f} s (no live node has room for it)"] * len(pending)
    for actor in actors:
        if actor not in placed:
            ray.kill(actor)
    for reason in reasons:
        log(WARNING, "[alignfl] a Ray worker of the batched engine %s; the others go on without it", reason)
    if not placed:
        raise RuntimeError(f"no Ray worker of the batched engine could be started: one {reasons[0]}")
    return placed


def _shares(count: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous (start, stop) shares of ``count`` messages over ``workers``, as equal as can be."""
    base, extra = divmod(count, workers)
    bounds = [0]
    for index in range(workers):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    return list(zip(bounds, bounds[1:], strict=False))
