"""The ClientApp: trains and evaluates the global model on this node's partition.

A node knows its partition from ``node_config`` (``partition-id``,
``num-partitions``); everything else comes from the run config, parsed by the
same schema as the server's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from alignfl.core.config import RunConfig
from alignfl.core.data import ClientData, DatasetMissingError, load_dataset
from alignfl.core.data.label_noise import noisy_labels
from alignfl.core.merging.repair import REPAIR_RECORD, sites_of, unit_statistics
from alignfl.core.model_io import build_run_model, independent_start, load_arrays, tensors_of
from alignfl.core.partitioning.partitions import client_split, partition_dataset
from alignfl.core.rounds.nodes import is_holdout
from alignfl.core.rounds.repair_round import QUERY_KEY, REPAIR_QUERY, SITE_KEY
from alignfl.core.rounds.replies import CONFIG_RECORD, METRICS_RECORD, MODEL_RECORD, NEW_CLIENT, NUM_EXAMPLES
from alignfl.core.training.sgd import round_generator, seed_torch, select_device
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.node_state import begin_message, end_train
from alignfl.fl_app.results import RAY_NODE_RECORD, ray_placement, where_this_runs
from alignfl.strategies import get_strategy
from alignfl.strategies.base import LocalUpdate


def node_partition(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from the node config, checked."""
    try:
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
    except KeyError as missing:
        raise ValueError(
            f"node config lacks {missing}; start the SuperNode with --node-config 'partition-id=<i> num-partitions=<n>'"
        ) from None
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"node config partition-id={partition_id} must lie in [0, num-partitions={num_partitions})")
    return partition_id, num_partitions


def check_pan_agreement(config: RunConfig, server_config: ConfigRecord) -> None:
    """Refuse to train or report when the server's PAN settings differ from this node's: the encodings
    are fixed per position, so a model trained under other encodings must not be averaged in."""
    mine = config.pan_signature()
    theirs = {key: server_config.get(key) for key in mine}
    if theirs != mine:
        raise ValueError(
            f"PAN settings differ: server {theirs}, this node {mine}; run every node with the same "
            "pan-mode, pan-t and pan-a"
        )


@lru_cache(maxsize=8)
def _parse_cached(items: frozenset[tuple[str, Any]]) -> RunConfig:
    return parse_run_config(dict(items))


def client_config(context: Context, overrides: Mapping[str, Any]) -> RunConfig:
    """The run config as this node sees it (parsed once per process)."""
    return _parse_cached(frozenset({**context.run_config, **overrides}.items()))


def client_data(config: RunConfig, partition_id: int, num_partitions: int) -> ClientData:
    """Slice this client's data out of the process-wide dataset and partition caches."""
    root = config.data_root or None
    dataset = load_dataset(config.dataset, root)
    partitions = partition_dataset(
        config.dataset, root, config.partitioner, num_partitions, config.seed, **config.partition_options()
    )
    train_idx, test_idx = client_split(
        partitions[partition_id], config.test_fraction, config.seed, partition_id, config.data_fraction
    )
    if len(train_idx) == 0:
        raise ValueError(
            f"partition {partition_id} of {num_partitions} has no training examples; use fewer "
            "clients, a larger dirichlet-alpha or another partitioner"
        )
    train, test = torch.as_tensor(train_idx, dtype=torch.long), torch.as_tensor(test_idx, dtype=torch.long)
    train_y = noisy_labels(
        dataset.train_y.index_select(0, train),
        dataset.num_classes,
        config.label_noise,
        config.label_noise_rate,
        config.seed,
        partition_id,
    )  # test labels stay clean
    # index_select with a tensor: numpy-array indexing of a tensor is several times slower (every message pays it)
    return ClientData(
        dataset.train_x.index_select(0, train),
        train_y,
        dataset.train_x.index_select(0, test),
        dataset.train_y.index_select(0, test),
    )


@lru_cache(maxsize=4)
def _model(config: RunConfig) -> tuple[nn.Module, torch.device]:
    """One model per process and configuration, reused across messages (weights are overwritten each time)."""
    dataset = load_dataset(config.dataset, config.data_root or None)
    device = select_device(config.device)
    return build_run_model(config, dataset).to(device), device


@dataclass(frozen=True)
class Sources:
    """Where a message's handling gets the client's data (config, partition id, number of partitions → its
    :class:`ClientData`) and the received arrays' tensors: Flower's ClientApp slices and deserialises per message,
    a worker that runs many messages may keep them."""

    data: Callable[[RunConfig, int, int], ClientData] = client_data
    arrays: Callable[[ArrayRecord], dict[str, torch.Tensor]] = tensors_of


PER_MESSAGE = Sources()


def _receive(
    message: Message, context: Context, overrides: Mapping[str, Any], sources: Sources = PER_MESSAGE
) -> tuple[RunConfig, int, ClientData, nn.Module, torch.device]:
    """Parse the config, locate the partition, set up the client's state (restored in a resumed run) and load
    the received global model."""
    config = client_config(context, overrides)
    check_pan_agreement(config, message.content[CONFIG_RECORD])
    partition_id, num_partitions = node_partition(context)
    begin_message(context, config, partition_id, int(message.content[CONFIG_RECORD]["server-round"]))
    try:
        model, device = _model(config)
        data = sources.data(config, partition_id, num_partitions)
    except DatasetMissingError as error:  # on a cluster, which node lacks it
        raise DatasetMissingError(f"this node{where_this_runs()} lacks the data set: {error}") from None
    arrays = message.content[MODEL_RECORD]
    load_arrays(model, arrays, sources.arrays(arrays))
    return config, partition_id, data, model, device


def start_independently(model: nn.Module, config: RunConfig, partition_id: int) -> None:
    """Replace the received model by this client's own initialisation (``client-init=independent``, round 1)."""
    dataset = load_dataset(config.dataset, config.data_root or None)
    state = independent_start(config, dataset.input_shape, dataset.num_classes, partition_id)
    load_arrays(model, ArrayRecord(state), state)


@dataclass
class TrainJob:
    """A training message received and its client set up, up to its local update's first step: the model holds
    the received global model, the generator is the client's round stream (its first draw seeded torch)."""

    message: Message
    context: Context
    config: RunConfig
    partition_id: int
    data: ClientData
    model: nn.Module
    device: torch.device
    generator: torch.Generator
    update: LocalUpdate


def begin_train(
    message: Message, context: Context, overrides: Mapping[str, Any], sources: Sources = PER_MESSAGE
) -> TrainJob:
    """Everything a training message does before its local update trains."""
    config, partition_id, data, model, device = _receive(message, context, overrides, sources)
    if is_holdout(partition_id, int(context.node_config["num-partitions"]), config.holdout_clients):
        raise ValueError(
            f"partition {partition_id} is held out (holdout-clients={config.holdout_clients}) "
            "and must not train; run the server with the same holdout-clients"
        )
    server_round = int(message.content[CONFIG_RECORD]["server-round"])
    if config.client_init == "independent" and server_round == 1:
        start_independently(model, config, partition_id)
    generator = round_generator(config.seed, server_round, partition_id)
    seed_torch(int(torch.randint(0, 2**62, (1,), generator=generator)), device)
    update = get_strategy(config.strategy).client(config, context, message.content)
    return TrainJob(message, context, config, partition_id, data, model, device, generator, update)


def repair_statistics(model: nn.Module, data: ClientData, device: torch.device, site: str | None = None) -> ArrayRecord:
    """``model``'s per-unit pre-activation statistics on the client's training split
    (:mod:`alignfl.core.merging.repair`): of every hidden layer, or of the layer (site) ``site``."""
    sites = sites_of(model, tuple(data.train_x.shape[1:]))
    if site is not None:
        sites = tuple(s for s in sites if s.name == site)
        if not sites:
            raise ValueError(f"the REPAIR query asks for layer {site!r}, which this model does not have")
    return ArrayRecord(unit_statistics(model, sites, data.train_x, device))


def finish_train(job: TrainJob, metrics: Mapping[str, Any]) -> Message:
    """The reply to a training message whose local update has trained ``job.model`` (with ``repair=on`` also its
    unit statistics on the client's training split); saves the client's state."""
    reply = RecordDict(
        {
            MODEL_RECORD: job.update.model_record(job.model),
            **job.update.reply_records(job.data),
            METRICS_RECORD: MetricRecord(
                {**metrics, NUM_EXAMPLES: len(job.data.train_y), "partition-id": job.partition_id}
            ),
        }
    )
    if job.config.repair == "on":
        reply[REPAIR_RECORD] = repair_statistics(job.model, job.data, job.device)
    placement = ray_placement()
    if placement is not None:  # the Ray node this client ran on, for the round's metrics
        reply[RAY_NODE_RECORD] = ConfigRecord(placement)
    end_train(job.context, job.config, job.partition_id, int(job.message.content[CONFIG_RECORD]["server-round"]))
    return Message(content=reply, reply_to=job.message)


def train_message(
    message: Message, context: Context, overrides: Mapping[str, Any], sources: Sources = PER_MESSAGE
) -> Message:
    """A training message's reply: the local update of the received model."""
    job = begin_train(message, context, overrides, sources)
    metrics = job.update.train(job.model, job.data.train_x, job.data.train_y, job.generator, job.device)
    return finish_train(job, metrics)


def evaluate_message(
    message: Message, context: Context, overrides: Mapping[str, Any], sources: Sources = PER_MESSAGE
) -> Message:
    """An evaluate message's reply: the client's scores of the received model on its local test split."""
    config, partition_id, data, model, device = _receive(message, context, overrides, sources)
    new_client = is_holdout(partition_id, int(context.node_config["num-partitions"]), config.holdout_clients)
    update = get_strategy(config.strategy).client(config, context, message.content)
    # Every reply has the same keys (Flower aggregates only those); a new client's ``local-*`` scores
    # are the global model's, which is all the server reads from it (its personal scores, if any, are of
    # a model that never trained).
    scores = update.evaluate(model, data, device)
    metrics = MetricRecord(
        {**scores, NUM_EXAMPLES: len(data.test_y), "partition-id": partition_id, NEW_CLIENT: int(new_client)}
    )
    return Message(content=RecordDict({METRICS_RECORD: metrics}), reply_to=message)


def repair_message(
    message: Message, context: Context, overrides: Mapping[str, Any], sources: Sources = PER_MESSAGE
) -> Message:
    """A REPAIR query's reply: the received (merged) model's unit statistics of the layer the query names, on the
    client's training split."""
    config, partition_id, data, model, device = _receive(message, context, overrides, sources)
    site = str(message.content[CONFIG_RECORD][SITE_KEY])
    metrics = MetricRecord({NUM_EXAMPLES: len(data.train_y), "partition-id": partition_id})
    return Message(
        content=RecordDict({REPAIR_RECORD: repair_statistics(model, data, device, site), METRICS_RECORD: metrics}),
        reply_to=message,
    )


def query_message(
    message: Message, context: Context, overrides: Mapping[str, Any] | None = None, sources: Sources = PER_MESSAGE
) -> Message:
    """What a QUERY message asks, by its content: a REPAIR query (:data:`alignfl.core.rounds.repair_round.REPAIR_QUERY`)
    gets the received model's unit statistics; any other query this node's partition, so seeded runs sample the same
    clients."""
    asked = message.content.config_records.get(CONFIG_RECORD)
    if asked is not None and asked.get(QUERY_KEY) == REPAIR_QUERY:
        return repair_message(message, context, overrides or {}, sources)
    partition_id, num_partitions = node_partition(context)
    metrics = MetricRecord({"partition-id": partition_id, "num-partitions": num_partitions})
    return Message(content=RecordDict({METRICS_RECORD: metrics}), reply_to=message)


def build_client_app(overrides: Mapping[str, Any] | None = None) -> ClientApp:
    """A ClientApp whose run config is ``context.run_config`` updated with ``overrides``."""
    overrides = dict(overrides or {})
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return train_message(message, context, overrides)

    @app.evaluate()
    def evaluate_local(message: Message, context: Context) -> Message:
        return evaluate_message(message, context, overrides)

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return query_message(message, context, overrides)

    return app


app = build_client_app()
