"""The one seam between alignfl and what Flower and Ray do not publish.

alignfl changes a few things in how Flower's runtimes behave (the other modules of :mod:`alignfl.fl_app.patches`) and
reads a few names that Flower and Ray keep private. Every such name is handed out here (:func:`get`), imported
only when it is asked for. Each patch is its replacement plus one :func:`install` call, which checks that the
installed release is one the patch was read on (:data:`CHECKED`), that every name it needs is there and that
each signature has the parameters it relies on; on any mismatch it logs one warning that says what is lost and
why, and Flower's own behaviour runs. A read that changes no behaviour (a constant, a serialiser) asks
:func:`usable`, which checks the names and signatures the same way but not the release.

Every internal alignfl touches, and who touches it for what (``tests/test_seam.py`` keeps this table and
:data:`INTERNALS` the same):

=============================================================================  =======================================
Internal                                                                       Who, for what
=============================================================================  =======================================
flwr.supernode.start_client_internal._pull_and_store_message                   polling_supernode: asked again every
                                                                               interval instead of the SuperNode's 3 s
                                                                               sleep
flwr.supercore.inflatable.inflatable_utils.pull_objects                        object_pulls: first retry after 0.05 s
flwr.supercore.inflatable.inflatable_utils.pull_and_inflate_object_from_tree   object_pulls: the same for a message's
                                                                               object tree
flwr.supercore.superexec.run_superexec.get_executor                            warm_superexec: answers the warm
                                                                               executor
flwr.supercore.constant.ExecutorType                                           warm_superexec: the executor asked for
flwr.supercore.constant.TaskType                                               warm_executor: which tasks are
                                                                               ClientApps
flwr.supercore.superexec.executor.SubprocessExecutor                           warm_executor: Flower's executor, for
                                                                               other tasks and as the fallback
flwr.supercore.superexec.executor.LaunchResult                                 warm_executor: a launch's answer
flwr.supercore.superexec.executor.ExecutionSpec                                benchmarks/deploy_round: a warm child's
                                                                               task, as a SuperNode's executor gets it
flwr.supernode.runtime.run_clientapp.run_clientapp                             warm_parent: what flwr-clientapp runs
flwr.supercore.tls.validate_and_resolve_root_certificates                      warm_parent: the task's certificates
flwr.server.superlink.linkstate.InMemoryLinkState.store_message_ins            flower_runtime: indexes each message
flwr.server.superlink.linkstate.InMemoryLinkState.get_message_ins              flower_runtime: the indexed lookup
flwr.server.superlink.linkstate.InMemoryLinkState._check_stored_messages       flower_runtime: the lookup's check of
                                                                               each message, as Flower's
flwr.superlink.grid.inmemory_grid.InMemoryGrid                                 flower_runtime: the simulation's grid
                                                                               and its node registry
flwr.superlink.grid.http_grid.HttpGrid                                         object_pulls: a deployed ServerApp's
                                                                               grid
flwr.supercore.date.now                                                        flower_runtime: marks messages
                                                                               delivered
flwr.server.superlink.fleet.vce.backend.raybackend.RayBackend.process_message  ray_pool: actors lost with their Ray
                                                                               node leave the pool
flwr.simulation.ray_transport.ray_actor.pool_size_from_resources               ray_pool: room for replacement actors
flwr.simulation.run_simulation                                                 benchmarks/benchutil: Flower's own Ray
                                                                               simulation driven from the benchmark's
                                                                               process, what overhead, scale,
                                                                               cross_device and ray_cluster_scale
                                                                               measure (deprecated by Flower)
flwr.common.serde.recorddict_to_proto                                          node_state: client state snapshots
flwr.common.serde.recorddict_from_proto                                        node_state: client state snapshots
flwr.proto.recorddict_pb2.RecordDict                                           node_state: the snapshots' format
flwr.common.constant.ErrorCode                                                 inprocess (and the batched engine): the
                                                                               code of an error reply
flwr.common.constant.PARTITION_ID_KEY                                          ray_pool: the node config's partition
                                                                               id, read as Flower's own reads it
flwr.supercore.task_identity.TaskIdentity                                      inprocess: the identity Flower stamps
                                                                               messages with
flwr.supercore.error.ApiErrorCode                                              runtime.flwr_cli: a key registered
                                                                               before
ray._private.state.state                                                       ray_pool: the node a lost actor was on
ray._private.services.canonicalize_bootstrap_address                           runtime.ray_cluster: resolves an
                                                                               address
ray._raylet.GcsClient                                                          runtime.ray_cluster: a cluster's live
                                                                               nodes
ray.core.generated.gcs_pb2.GcsNodeInfo                                         runtime.ray_cluster: a node's state
ray._private.worker._global_node                                               results: whether the run joined a
                                                                               cluster
=============================================================================  =======================================

Flower's commands (``flower-supernode``, ``flower-superexec``, ``flwr-clientapp``) are not internals:
:func:`flower_command` loads them from their public console-script entry points, and
:func:`flower_command_module` names the module one is imported from.

The benchmarks (``benchmarks/``) read internals here too, as the app does: the table names them by file.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import EntryPoint, entry_points, version
from logging import WARNING
from typing import Any

CHECKED = {"flwr": frozenset({"1.41.0", "1.42.0"}), "ray": frozenset({"2.55.1"})}
"""Package → the releases whose internals (those of :data:`INTERNALS`) were read and each patch checked on.
Flower 1.42.0 changed none of them against 1.41.0 (``run_superexec`` lost a tracing argument; the
``get_executor`` it looks up is the same); both install Ray 2.55.1."""
NAMES = {"flwr": "Flower", "ray": "Ray"}


@dataclass(frozen=True)
class Internal:
    """A name Flower or Ray does not publish, as alignfl reads it.

    ``name`` is an attribute of ``module`` (``Class.method`` for a method). ``parameters`` are those its
    signature must have; a name written ``*name`` must be keyword-only with a default (a patch changes the
    default).
    """

    module: str
    name: str
    parameters: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def package(self) -> str:
        return self.module.partition(".")[0]


def _table(*internals: Internal) -> dict[str, Internal]:
    return {internal.key: internal for internal in internals}


_PULLS = "flwr.supercore.inflatable.inflatable_utils"
_LINKSTATE = "flwr.server.superlink.linkstate"
_EXECUTOR = "flwr.supercore.superexec.executor"
INTERNALS = _table(
    Internal(
        "flwr.supernode.start_client_internal",
        "_pull_and_store_message",
        ("state", "object_store", "node_config", "receive", "get_run", "get_fab", "pull_object"),
    ),
    Internal(_PULLS, "pull_objects", ("*initial_backoff",)),
    Internal(_PULLS, "pull_and_inflate_object_from_tree", ("*initial_backoff",)),
    Internal(
        "flwr.supercore.superexec.run_superexec",
        "get_executor",
        ("executor_type", "executor_config", "insecure", "root_certificates_path"),
    ),
    Internal("flwr.supercore.constant", "ExecutorType"),
    Internal("flwr.supercore.constant", "TaskType"),
    Internal(_EXECUTOR, "SubprocessExecutor"),
    Internal(_EXECUTOR, "LaunchResult"),
    Internal(
        _EXECUTOR,
        "ExecutionSpec",
        (
            "task_type",
            "runtime_api_address",
            "token",
            "insecure",
            "root_certificates_path",
            "runtime_dependency_install",
            "parent_pid",
            "suppress_output",
            "task_id",
        ),
    ),
    Internal(
        "flwr.supernode.runtime.run_clientapp",
        "run_clientapp",
        ("runtime_api_address", "token", "insecure", "certificates", "parent_pid", "runtime_dependency_install"),
    ),
    Internal("flwr.supercore.tls", "validate_and_resolve_root_certificates", ("root_cert_path", "insecure")),
    Internal(_LINKSTATE, "InMemoryLinkState.store_message_ins", ("self", "message")),
    Internal(_LINKSTATE, "InMemoryLinkState.get_message_ins", ("self", "node_id", "limit", "run_id")),
    Internal(_LINKSTATE, "InMemoryLinkState._check_stored_messages", ("self", "message_ids")),
    Internal("flwr.superlink.grid.inmemory_grid", "InMemoryGrid"),
    Internal("flwr.superlink.grid.http_grid", "HttpGrid"),
    Internal("flwr.supercore.date", "now"),
    Internal(
        "flwr.server.superlink.fleet.vce.backend.raybackend",
        "RayBackend.process_message",
        ("self", "message", "context"),
    ),
    Internal("flwr.simulation.ray_transport.ray_actor", "pool_size_from_resources", ("client_resources",)),
    Internal("flwr.simulation", "run_simulation", ("server_app", "client_app", "num_supernodes", "backend_config")),
    Internal("flwr.common.serde", "recorddict_to_proto"),
    Internal("flwr.common.serde", "recorddict_from_proto"),
    Internal("flwr.proto.recorddict_pb2", "RecordDict"),
    Internal("flwr.common.constant", "ErrorCode"),
    Internal("flwr.common.constant", "PARTITION_ID_KEY"),
    Internal("flwr.supercore.task_identity", "TaskIdentity"),
    Internal("flwr.supercore.error", "ApiErrorCode"),
    Internal("ray._private.state", "state"),
    Internal("ray._private.services", "canonicalize_bootstrap_address", ("addr",)),
    Internal("ray._raylet", "GcsClient"),
    Internal("ray.core.generated.gcs_pb2", "GcsNodeInfo"),
    Internal("ray._private.worker", "_global_node"),
)
"""Every internal alignfl touches, by ``module.name`` (the module docstring's table says who uses it)."""

_ORIGINALS: dict[str, Any] = {}
"""``module.name`` → what Flower had there before :func:`replace` put alignfl's replacement in its place."""


class Unavailable(LookupError):
    """An internal that is not there as it was read; the message says what differs."""


@cache
def release(package: str) -> str:
    """The installed release of ``package`` (``flwr`` or ``ray``), read once per process."""
    return version(package)


def release_problem(package: str) -> str | None:
    """Why ``package``'s installed release is not one alignfl was checked on, or None."""
    installed = release(package)
    if installed in CHECKED[package]:
        return None
    checked = ", ".join(sorted(CHECKED[package]))
    return f"{NAMES[package]} {installed} is not a release alignfl was checked against ({checked})"


def _owner(internal: Internal) -> tuple[Any, str]:
    """The object that holds the internal (its module, or its class) and the attribute's name there."""
    try:
        owner: Any = importlib.import_module(internal.module)
    except ImportError as error:
        raise Unavailable(f"{internal.module} does not import ({error})") from None
    *path, attribute = internal.name.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            raise Unavailable(f"{internal.module} has no {part}")
    if not hasattr(owner, attribute):
        raise Unavailable(f"{internal.module} has no {internal.name}")
    return owner, attribute


def _signature_problem(internal: Internal, found: Any) -> str | None:
    """Which of the internal's expected parameters its signature lacks, or None."""
    try:
        parameters = inspect.signature(found).parameters
    except (TypeError, ValueError):
        parameters = {}
    missing = []
    for expected in internal.parameters:
        name = expected.lstrip("*")
        parameter = parameters.get(name)
        if parameter is None or (
            expected.startswith("*")
            and (parameter.kind is not parameter.KEYWORD_ONLY or parameter.default is parameter.empty)
        ):
            missing.append(expected)
    if not missing:
        return None
    return f"{internal.key} has no parameter {', '.join(missing)} (a * marks a keyword with a default)"


def get(key: str) -> Any:
    """An internal, imported now: Flower's own even where a patch replaced it.

    Parameters
    ----------
    key : str
        ``module.name`` as in :data:`INTERNALS`.

    Returns
    -------
    Any
        The module attribute (or class member) the key names.

    Raises
    ------
    Unavailable
        Where its module does not import, it is missing, or its signature lacks a parameter alignfl relies on.
    """
    internal = INTERNALS[key]
    owner, attribute = _owner(internal)
    found = _ORIGINALS[key] if key in _ORIGINALS else getattr(owner, attribute)
    if internal.parameters:
        problem = _signature_problem(internal, found)
        if problem is not None:
            raise Unavailable(problem)
    return found


def problem(*keys: str) -> str | None:
    """Why one of these internals cannot be used here (the first found), or None."""
    for key in keys:
        try:
            get(key)
        except Unavailable as error:
            return str(error)
    return None


@cache
def warn_once(lost: str, why: str) -> None:
    """Log that ``lost`` is lost and ``why``, once per process."""
    from flwr.common.logger import log

    log(WARNING, "[alignfl] %s: %s", lost, why)


def usable(lost: str, *keys: str) -> bool:
    """Whether every internal of ``keys`` is there as read (any release); where not, warn once.

    Parameters
    ----------
    lost : str
        What alignfl does without them, for the warning.
    *keys : str
        Keys of :data:`INTERNALS`.

    Returns
    -------
    bool
        True where :func:`get` answers every key.
    """
    why = problem(*keys)
    if why is not None:
        warn_once(lost, why)
    return why is None


def loaded(key: str) -> bool:
    """Whether the internal's module is imported already (nothing is imported to find out)."""
    return INTERNALS[key].module in sys.modules


@dataclass(frozen=True)
class Patch:
    """A change to Flower's or Ray's behaviour: what it needs, and what is lost where it cannot be installed."""

    lost: str
    """Said in the warning, e.g. "the SuperNode polls every 3 s as Flower's own does"."""
    needs: tuple[str, ...]
    """The keys of :data:`INTERNALS` it reads or replaces."""


def install(patch: Patch, apply: Callable[[], None]) -> bool:
    """Install a patch where it was checked; elsewhere warn once and leave Flower's behaviour.

    Parameters
    ----------
    patch : Patch
        What the patch needs, and what is lost without it.
    apply : Callable[[], None]
        Installs it, through :func:`get` and :func:`replace`; run only where the installed releases are ones
        the patch was checked on (:data:`CHECKED`) and every internal it needs is there as read.

    Returns
    -------
    bool
        Whether ``apply`` ran.

    Examples
    --------
    >>> PATCH = Patch(lost="messages are marked with Flower's clock", needs=("flwr.supercore.date.now",))
    >>> install(PATCH, lambda: None)
    True
    """
    packages = sorted({INTERNALS[key].package for key in patch.needs})
    why = next(filter(None, map(release_problem, packages)), None) or problem(*patch.needs)
    if why is not None:
        warn_once(patch.lost, why)
        return False
    apply()
    return True


def replace(key: str, replacement: Any) -> None:
    """Put ``replacement`` where Flower looks the internal ``key`` up; :func:`get` still answers Flower's own."""
    owner, attribute = _owner(INTERNALS[key])
    _ORIGINALS.setdefault(key, getattr(owner, attribute))
    setattr(owner, attribute, replacement)


def restore(key: str) -> None:
    """Flower's own back in place of a replacement (tests)."""
    if key in _ORIGINALS:
        owner, attribute = _owner(INTERNALS[key])
        setattr(owner, attribute, _ORIGINALS.pop(key))


def replaced(key: str) -> Any:
    """What is in place of the internal ``key`` now (alignfl's replacement, or Flower's own)."""
    owner, attribute = _owner(INTERNALS[key])
    return getattr(owner, attribute)


def _flower_entry_point(name: str) -> EntryPoint:
    (command,) = entry_points(group="console_scripts", name=name)
    return command


def flower_command(name: str) -> Callable[[], Any]:
    """Flower's command ``name`` (``flower-supernode``, ``flower-superexec``) as its console script runs it."""
    return _flower_entry_point(name).load()


def flower_command_module(name: str) -> str:
    """The module Flower's command ``name`` (``flwr-clientapp``) is imported from, as its console script does
    first; nothing is imported to find out."""
    return _flower_entry_point(name).module
