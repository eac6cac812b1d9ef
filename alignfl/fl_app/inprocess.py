"""The real ServerApp and ClientApp in one process, without Ray or a SuperLink.

:class:`InProcessGrid` is a Flower ``Grid`` whose nodes call a ClientApp directly, each with
its own ``Context`` (its partition in ``node_config``, its ``state`` kept across rounds), and
whose messages get ids as Flower's grids give them. :func:`run_in_process` runs one
experiment through it: what tests and quick experiments use when Ray and ``flwr run`` are
not what they measure.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.config import parse_run_config
from alignfl.fl_app.patches import seam
from alignfl.fl_app.server_app import run_experiment

FIRST_NODE_ID = 1000
NODE_ID_STRIDE = 7919  # node ids far apart and not in partition order, as a real SuperLink's are


TASK_IDENTITY = "flwr.supercore.task_identity.TaskIdentity"
ERROR_CODE = "flwr.common.constant.ErrorCode"
UNKNOWN_ERROR = 0
"""Flower's ``ErrorCode.UNKNOWN``: the code of an error reply where ``ErrorCode`` is not there as read."""


def set_task_identity() -> None:
    """Flower stamps every message with the process's task identity, which its runtimes set; here none runs."""
    if not seam.usable("the in-process grid sets no task identity for Flower to stamp messages with", TASK_IDENTITY):
        return
    identity = seam.get(TASK_IDENTITY)
    for name in ("_task_id", "_run_id", "_node_id"):
        if getattr(identity, name, None) is None:
            setattr(identity, name, 1)


def flower_error(message: Message, reason: str, code: str = "CLIENT_APP_RAISED_EXCEPTION") -> Message:
    """The error reply Flower's runtimes give ``message``, with Flower's error code ``code`` (its ``ErrorCode`` is
    not public: read through the seam, and ``UNKNOWN`` where it has moved)."""
    number = UNKNOWN_ERROR
    if seam.usable(f"error replies carry Flower's code UNKNOWN ({UNKNOWN_ERROR}) instead of {code}", ERROR_CODE):
        number = int(getattr(seam.get(ERROR_CODE), code))
    return Message(Error(number, reason), reply_to=message)


def give_message_id(message: Message) -> None:
    """Give a message the fresh id Flower's grids give it when they push it."""
    message.metadata.__dict__["_message_id"] = uuid.uuid4().hex


def node_contexts(num_nodes: int, first_node_id: int = FIRST_NODE_ID) -> dict[int, Context]:
    """The simulated nodes' contexts by node id: partition ``p`` on node ``first_node_id + NODE_ID_STRIDE * p``,
    each with its own ``state`` that lasts the run."""
    return {
        first_node_id + NODE_ID_STRIDE * p: Context(
            run_id=1,
            node_id=first_node_id + NODE_ID_STRIDE * p,
            node_config={"partition-id": p, "num-partitions": num_nodes},
            state=RecordDict(),
            run_config={},
        )
        for p in range(num_nodes)
    }


class InProcessGrid:
    """A Grid whose ``num_nodes`` nodes call ``app`` in this process (replies come back in sending order)."""

    def __init__(self, app: ClientApp, num_nodes: int, first_node_id: int = FIRST_NODE_ID) -> None:
        set_task_identity()
        self.app = app
        self.contexts = node_contexts(num_nodes, first_node_id)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return [reply for message in messages if (reply := self.deliver(message)) is not None]

    def deliver(self, message: Message) -> Message | None:
        """One message to its node; a ClientApp that raises gives an error reply, as Flower's runtimes do."""
        give_message_id(message)
        context = self.contexts[message.metadata.dst_node_id]
        try:
            return self.app(copy.deepcopy(message), context)
        except Exception as error:
            return flower_error(message, f"{type(error).__name__}: {error}")


def run_in_process(values: Mapping[str, Any], num_nodes: int) -> dict[str, Any]:
    """One experiment with the real apps on ``num_nodes`` in-process nodes; returns its summary."""
    values = {**values, "min-available-nodes": num_nodes}
    grid = InProcessGrid(build_client_app(values), num_nodes)
    return run_experiment(grid, parse_run_config(values))  # type: ignore[arg-type]
