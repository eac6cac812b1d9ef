"""A worker of the batched engine: runs many nodes' messages in one call, through the ClientApp's own logic.

A worker lives as long as the run (in the ServerApp's process, or as a Ray actor). It keeps each client's
data once sliced (training splits also on the model's device, for stacked updates) and the ClientApp's model
per configuration, and runs each message as :mod:`alignfl.fl_app.client_app` runs it under Flower: the same seeds,
batches and replies. Training messages of an algorithm whose local update vectorises
(:attr:`alignfl.strategies.base.LocalUpdate.not_vectorised`) train as one stacked update
(:class:`alignfl.core.training.vectorised.StackedTrainer`) when the worker is asked to; everything the ClientApp does
before and after the local steps is still done per message. A message that raises gets an error reply with the
reason, as Flower's runtimes give it, and the worker goes on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from logging import WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MessageType
from flwr.common.logger import log

from alignfl.core.config import RunConfig
from alignfl.core.data import ClientData
from alignfl.core.model_io import tensors_of
from alignfl.core.training.sgd import batch_order
from alignfl.core.training.vectorised import ClientSteps, StackedTrainer, clients_per_stack, stacked_state_names
from alignfl.fl_app.client_app import (
    Sources,
    TrainJob,
    begin_train,
    client_data,
    evaluate_message,
    finish_train,
    query_message,
    train_message,
)
from alignfl.fl_app.inprocess import flower_error

Job = tuple[Message, Context]
Member = tuple[int, TrainJob, dict[str, torch.Tensor]]
"""A training message of a stacked group: its index in the batch of messages, its job, its starting state."""


def error_reply(message: Message, error: BaseException) -> Message:
    """The reply Flower's runtimes give a message whose ClientApp raised."""
    return flower_error(message, f"{type(error).__name__}: {error}")


class Worker:
    """Runs messages for any node; ``overrides`` are the ClientApp's run config (as ``build_client_app``'s),
    ``vectorise`` whether training messages of a vectorising algorithm train stacked."""

    def __init__(self, overrides: Mapping[str, Any], vectorise: bool) -> None:
        self.overrides = dict(overrides)
        self.vectorise = vectorise
        self._data: dict[tuple[RunConfig, int, int], ClientData] = {}
        self._device_data: dict[tuple[RunConfig, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._fell_back = False
        self._received: dict[int, tuple[ArrayRecord, dict[str, torch.Tensor]]] = {}
        self.sources = Sources(self.data, self.arrays)

    def data(self, config: RunConfig, partition_id: int, num_partitions: int) -> ClientData:
        """A client's data, sliced once per worker."""
        key = (config, partition_id, num_partitions)
        if key not in self._data:
            self._data[key] = client_data(config, partition_id, num_partitions)
        return self._data[key]

    def arrays(self, record: ArrayRecord) -> dict[str, torch.Tensor]:
        """A received ArrayRecord's tensors, deserialised once per :meth:`run` (a round's messages share one)."""
        if id(record) not in self._received:
            self._received[id(record)] = (record, tensors_of(record))
        return self._received[id(record)][1]

    def run(self, jobs: Sequence[Job]) -> list[Message]:
        """One reply per message, in the order given; ``context.state`` of each node is updated in place."""
        self._received = {}
        try:
            return self._run(jobs)
        finally:
            self._received = {}

    def _run(self, jobs: Sequence[Job]) -> list[Message]:
        replies: list[Message | None] = [None] * len(jobs)
        stacked = [
            i for i, (m, _) in enumerate(jobs) if self.vectorise and m.metadata.message_type == MessageType.TRAIN
        ]
        if len(stacked) > 1:
            for index, reply in zip(stacked, self._train_stacked([jobs[i] for i in stacked]), strict=True):
                replies[index] = reply
        for index, (message, context) in enumerate(jobs):
            if replies[index] is None:
                replies[index] = self._one(message, context)
        return replies  # type: ignore[return-value]

    def _one(self, message: Message, context: Context) -> Message:
        try:
            kind = message.metadata.message_type
            if kind == MessageType.TRAIN:
                return train_message(message, context, self.overrides, self.sources)
            if kind == MessageType.EVALUATE:
                return evaluate_message(message, context, self.overrides, self.sources)
            if kind == MessageType.QUERY:
                return query_message(message, context, self.overrides, self.sources)
            raise ValueError(f"message type {kind!r} is not one this ClientApp handles (train, evaluate, query)")
        except Exception as error:
            return error_reply(message, error)

    def _train_stacked(self, jobs: Sequence[Job]) -> list[Message | None]:
        """Replies of training messages trained as stacked updates, grouped by what must be equal within one
        (configuration, learning rate, epochs, frozen parameters, state shapes); None for a message left to the
        sequential path."""
        replies: list[Message | None] = [None] * len(jobs)
        groups: dict[tuple[Any, ...], list[Member]] = {}
        for index, (message, context) in enumerate(jobs):
            try:
                job = begin_train(message, context, self.overrides, self.sources)
                if job.update.not_vectorised is not None:
                    continue
                start = stack_start(job)
            except Exception as error:
                replies[index] = error_reply(message, error)
                continue
            shapes = tuple((n, tuple(t.shape)) for n, t in start.items())
            update = job.update
            key = (
                job.config,
                type(update),
                update.learning_rate(),
                update.local_epochs(),
                update.frozen(job.model),
                shapes,
            )
            groups.setdefault(key, []).append((index, job, start))
        for members in (chunk for group in groups.values() for chunk in stacks_of(group)):
            if len(members) < 2:
                continue  # one client: the sequential path is the same work
            try:
                trained = self._stack(members)
            except Exception as error:  # e.g. an operation vmap cannot batch: train these one by one instead
                if not self._fell_back:
                    log(
                        WARNING,
                        "[alignfl] stacked update failed (%s: %s); training one by one",
                        type(error).__name__,
                        error,
                    )
                    self._fell_back = True
                continue
            for index, reply in trained.items():
                replies[index] = reply
        return replies

    def _stack(self, members: list[Member]) -> dict[int, Message]:
        jobs = [job for _, job, _ in members]
        replies = train_stacked(jobs, [start for _, _, start in members], [self._on_device(job) for job in jobs])
        return {index: reply for (index, _, _), reply in zip(members, replies, strict=True)}

    def _on_device(self, job: TrainJob) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's training split on the model's device, kept there."""
        key = (job.config, job.partition_id, int(job.context.node_config["num-partitions"]))
        if key not in self._device_data:
            self._device_data[key] = (job.data.train_x.to(job.device), job.data.train_y.to(job.device))
        return self._device_data[key]


def stacks_of(group: list[Member]) -> list[list[Member]]:
    """A group's clients as stacked updates of at most :func:`clients_per_stack` clients each, of as equal sizes as
    can be (one stacked update where the model has no limit)."""
    model = group[0][1].model
    most = clients_per_stack(model, next(model.parameters()).device.type == "cuda") or len(group)
    count = -(-len(group) // most)
    return [group[index::count] for index in range(count)]


def stack_start(job: TrainJob) -> dict[str, torch.Tensor]:
    """Begin the job's local update on the model it loaded (:meth:`LocalUpdate.begin`); the state (parameters
    and persistent buffers) its stacked update starts from."""
    job.update.begin(job.model)
    names = [name for group in stacked_state_names(job.model) for name in group]
    state = job.model.state_dict()
    return {name: state[name].detach().clone() for name in names}


def train_stacked(
    jobs: Sequence[TrainJob],
    starts: Sequence[Mapping[str, torch.Tensor]],
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[Message]:
    """The replies of training jobs of one configuration, update class and learning rate, their local updates
    run as one stacked update from ``starts`` (:func:`stack_start`) on their training splits ``data``; each job
    then ends as the ClientApp ends it (:meth:`LocalUpdate.end`, then :func:`alignfl.fl_app.client_app.finish_train`
    with its model holding the client's trained state). A job whose ending raises gets an error reply."""
    first = jobs[0]
    config, update = first.config, first.update
    trainer = StackedTrainer(
        first.model,
        starts,
        update.learning_rate(),
        config.momentum,
        config.weight_decay,
        update.proximal_mu(),
        update.frozen(first.model),
    )
    clients = []
    for job, (x, y) in zip(jobs, data, strict=True):
        epochs = range(update.local_epochs())
        batches = [batch for _ in epochs for batch in batch_order(len(y), config.batch_size, job.generator)]
        clients.append(ClientSteps(x, y, batches, job.update.gradient_correction()))
    result = trainer.run(clients)
    replies = []
    for position, job in enumerate(jobs):
        try:
            job.model.load_state_dict(result.states[position])
            job.update.steps = result.steps(position)
            total = 0.0
            for loss in result.losses[position]:  # summed as the sequential update sums them
                total += loss
            replies.append(finish_train(job, job.update.end(job.model, total)))
        except Exception as error:
            replies.append(error_reply(job.message, error))
    return replies
