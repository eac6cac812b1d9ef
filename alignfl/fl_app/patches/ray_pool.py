"""What alignfl changes in Flower's Ray backend: actors lost with their node leave the actor pool.

Flower's ``RayBackend.process_message`` takes an idle actor from its ``BasicActorPool``, runs the message on it
and puts the actor back, also when the call failed. When a node of the cluster is lost, its actors are dead,
yet they go back to the pool and are handed a message in every later round, which fails at once with Ray's
raw ``ActorDiedError`` (seen: rounds 4-6 of a 6-round run aggregated 2 of 4 clients after the second of two
nodes was lost in round 2).

:func:`drop_lost_actors` installs a ``process_message`` that does what Flower's does, except when Ray reports
the actor lost (``RayActorError``): the message fails with a reason that names the lost node (its id and
address, from the GCS's actor table), the actor and the idle actors on the same node leave the pool, and,
where the live nodes have room for more actors than the pool now has, new actors are added (Ray places them
on a node that can hold them). Flower runs one worker thread per actor it started with: a thread that finds no
idle actor waits for one, and fails its message when no actor is left at all, so a run never hangs. It is
installed through :mod:`alignfl.fl_app.patches.seam`: where the installed Flower or Ray is not one whose backend and
actor table were read, or a name is not there as read, the pool is Flower's own and the log says so.
"""

from __future__ import annotations

import threading
import time
from logging import WARNING
from typing import Any

from flwr.app import Context, Message
from flwr.common.logger import log

from alignfl.fl_app.patches import seam

PROCESS_MESSAGE = "flwr.server.superlink.fleet.vce.backend.raybackend.RayBackend.process_message"
POOL_SIZE = "flwr.simulation.ray_transport.ray_actor.pool_size_from_resources"
ACTOR_TABLE = "ray._private.state.state"
PARTITION_ID = "flwr.common.constant.PARTITION_ID_KEY"
PATCH = seam.Patch(
    lost="Flower's Ray actor pool keeps the actors of a lost Ray node, and hands them messages that fail",
    needs=(PROCESS_MESSAGE, POOL_SIZE, ACTOR_TABLE, PARTITION_ID),
)
"""Flower's ``RayBackend.process_message`` and its ``BasicActorPool`` (``pool``, ``num_actors``,
``client_resources``, ``add_actors_to_pool``), the node-config key it reads the partition under, and Ray's actor
table."""
BasicActorPool = Any
RayBackend = Any
_LOCK = "_alignfl_actors_changed"
REPLACE_WAIT_S = 120.0


class RayNodeLost(RuntimeError):
    """The Ray node a message ran on was lost with the message in flight."""


def _condition(pool: BasicActorPool) -> threading.Condition:
    """The pool's condition, notified whenever an actor goes back to it or leaves it."""
    condition = pool.__dict__.get(_LOCK)
    if condition is None:
        condition = pool.__dict__.setdefault(_LOCK, threading.Condition())
    return condition


def actor_node(actor: Any) -> tuple[str, str, str]:
    """``(state, node id, node address)`` of an actor, from the GCS's actor table (empty strings when unknown)."""
    try:
        info = seam.get(ACTOR_TABLE).actor_table(actor._actor_id.hex())  # what `ray list actors` reads
    except Exception:  # the GCS may be unreachable too
        return "", "", ""
    address = info.get("Address") or {}
    return str(info.get("State", "")), str(address.get("NodeID", "")), str(address.get("IPAddress", ""))


def _take_actor(pool: BasicActorPool) -> Any:
    """An idle actor, waiting until one is; raises when the pool has no actor left."""
    with _condition(pool):
        while not pool.pool:
            if pool.num_actors <= 0:
                raise RayNodeLost("no ClientApp actor is left on the Ray cluster: every node that held one was lost")
            _condition(pool).wait(timeout=1.0)
        return pool.pool.pop()


def _give_back(pool: BasicActorPool, actor: Any) -> None:
    with _condition(pool):
        pool.pool.append(actor)
        _condition(pool).notify()


def _retire(pool: BasicActorPool, actor: Any, node_id: str) -> int:
    """Remove ``actor`` and every idle actor on ``node_id`` (or dead) from the pool; returns how many actors the
    pool has now. Replacements are added once the GCS has marked the node dead (:func:`_replace`)."""
    with _condition(pool):
        lost = [idle for idle in pool.pool if (where := actor_node(idle))[0] == "DEAD" or where[1] == node_id]
        pool.pool = [idle for idle in pool.pool if idle not in lost]
        pool.num_actors -= 1 + len(lost)
        _condition(pool).notify_all()
        remaining = pool.num_actors
    if node_id:
        threading.Thread(target=_replace, args=(pool, node_id), daemon=True).start()
    return remaining


def _node_dead(node_id: str) -> bool:
    import ray

    return not any(node["NodeID"] == node_id and node["Alive"] for node in ray.nodes())


def _replace(pool: BasicActorPool, node_id: str, wait_s: float = REPLACE_WAIT_S) -> None:
    """Once the GCS has marked ``node_id`` dead (it counts a lost node's resources until then), add the actors
    that the live nodes have room for beyond the pool's; Ray places them where they fit. A node still listed
    after ``wait_s`` gets no replacement (an actor that fits nowhere would hold its message forever)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        if not ray.is_initialized() or time.monotonic() > deadline:  # the simulation ended meanwhile
            return
        try:
            if _node_dead(node_id):
                break
        except ray.exceptions.RaySystemError:  # Ray shut down between the two checks
            return
        time.sleep(1.0)
    with _condition(pool):
        try:
            room = pool_size(pool.client_resources) - pool.num_actors
        except ValueError:  # Flower's "ActorPool is empty": no live node can hold an actor
            room = 0
        if room > 0:
            pool.add_actors_to_pool(room)
            log(WARNING, "[alignfl] %d new ClientApp actor(s) in place of those lost with Ray node %s", room, node_id)
            _condition(pool).notify_all()


def pool_size(client_resources: dict[str, float]) -> int:
    """How many actors of these resources the cluster's live nodes hold (Flower's own count)."""
    return seam.get(POOL_SIZE)(client_resources)


def process_message(backend: RayBackend, message: Message, context: Context) -> tuple[Message, Context]:
    """Flower's ``RayBackend.process_message``, but an actor Ray reports lost leaves the pool (see the module)."""
    import ray

    pool = backend.pool
    if pool is None or backend.app_fn is None:
        return seam.get(PROCESS_MESSAGE)(backend, message, context)
    actor = _take_actor(pool)
    partition_id = context.node_config[seam.get(PARTITION_ID)]
    try:
        _, reply, updated = ray.get(actor.run.remote(backend.app_fn, message, str(partition_id), context))
    except ray.exceptions.RayActorError as error:
        state, node_id, address = actor_node(actor)
        remaining = _retire(pool, actor, node_id)
        where = f"Ray node {node_id} ({address})" if node_id else "its Ray node"
        log(WARNING, "[alignfl] lost %s (actor %s); %d ClientApp actor(s) left", where, state or "unknown", remaining)
        raise RayNodeLost(
            f"the client's actor was lost with {where} ({type(error).__name__}); it left the actor "
            f"pool, {remaining} actor(s) remain and the next rounds train on them"
        ) from None
    except BaseException:
        _give_back(pool, actor)
        raise
    _give_back(pool, actor)
    return reply, updated


def drop_lost_actors() -> bool:
    """Install :func:`process_message` on Flower's ``RayBackend`` (once per process); False where it cannot be
    installed here (the seam has warned)."""

    def apply() -> None:
        if seam.replaced(PROCESS_MESSAGE) is not process_message:
            seam.replace(PROCESS_MESSAGE, process_message)

    return seam.install(PATCH, apply)
