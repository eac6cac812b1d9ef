"""Simulations on a running Ray cluster: the address checked before anything starts.

Flower's simulation calls ``ray.init()``, which joins a running cluster when given its address (``RAY_ADDRESS``
or ``init_args.address``) and then refuses resource counts (``num_cpus``, ``num_gpus``): the cluster's nodes
declared theirs when they were started, and the per-client ``num-cpus``/``num-gpus`` decide where each
ClientApp actor goes. :func:`check_ray_address` asks the cluster's GCS for its live nodes (half a second), so a
wrong address is refused before a SuperLink starts instead of after ``ray.init`` has waited for it for 30 s or
more. Where each client ran is recorded by the apps (:func:`alignfl.fl_app.results.ray_placement`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from alignfl.fl_app.patches import seam
from alignfl.plugins.options import ConfigError

RESOLVE = "ray._private.services.canonicalize_bootstrap_address"
GCS_CLIENT = "ray._raylet.GcsClient"
NODE_INFO = "ray.core.generated.gcs_pb2.GcsNodeInfo"
UNCHECKED = (
    "a Ray address is not checked before the run starts (Ray itself waits 30 s or more for a wrong one), nor "
    "are the client resources checked against the cluster's nodes"
)
GCS_TIMEOUT_S = 5.0
START_HINT = (
    "start a cluster with `ray start --head --port 6379` on one machine and `ray start --address "
    "HEAD_IP:6379` on each other one, then pass HEAD_IP:6379 (or `auto` on the head)"
)


@dataclass(frozen=True)
class RayNode:
    """A live node of a Ray cluster, as its GCS lists it."""

    node_id: str
    address: str
    """The node's IP and its raylet's port."""
    resources: dict[str, float]

    @property
    def is_head(self) -> bool:
        return "node:__internal_head__" in self.resources


def resolve_ray_address(address: str) -> str:
    """``host:port`` of a cluster's GCS; ``auto`` is Ray's own lookup (``RAY_ADDRESS``, then the cluster the last
    ``ray start`` on this machine started)."""
    try:
        resolved = seam.get(RESOLVE)(address)
    except (ConnectionError, ValueError) as error:
        raise ValueError(f"{error}") from None
    if resolved is None:
        raise ValueError("it names no running cluster")
    return resolved


def cluster_nodes(address: str, timeout_s: float = GCS_TIMEOUT_S) -> list[RayNode]:
    """The live nodes of the cluster whose GCS is at ``host:port`` (raises ``ConnectionError`` when it does not
    answer). A TCP connection is tried first: Ray's own client waits 30 s for an address where nothing listens."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s):
        pass
    alive = seam.get(NODE_INFO).GcsNodeState.ALIVE
    try:  # Ray's client of the GCS, what `ray status` uses
        nodes = seam.get(GCS_CLIENT)(address=address).get_all_node_info(timeout=timeout_s)
    except Exception as error:  # Ray raises its own RpcError
        raise ConnectionError(f"its GCS did not answer: {error}") from None
    return [
        RayNode(node_id.hex(), f"{info.node_manager_address}:{info.node_manager_port}", dict(info.resources_total))
        for node_id, info in nodes.items()
        if info.state == alive
    ]


def check_ray_address(address: str, option: str) -> tuple[str, list[RayNode]]:
    """The resolved ``host:port`` of a running cluster and its live nodes, or a :class:`ConfigError` that names
    ``option``, the address and how to start a cluster."""
    try:
        resolved = resolve_ray_address(address)
        nodes = cluster_nodes(resolved)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{option}={address!r}: no Ray cluster answers there ({error}); {START_HINT}") from None
    if not nodes:
        raise ConfigError(f"{option}={address!r}: the Ray cluster at {resolved} has no live node; {START_HINT}")
    return resolved, nodes


def describe_cluster(address: str, nodes: list[RayNode]) -> str:
    """One line for the log: where the run goes and what the cluster holds."""
    cpus = sum(node.resources.get("CPU", 0.0) for node in nodes)
    gpus = sum(node.resources.get("GPU", 0.0) for node in nodes)
    return f"Ray cluster {address}: {len(nodes)} live node(s), {cpus:g} CPUs, {gpus:g} GPUs"


def check_client_fits(nodes: list[RayNode], num_cpus: float, num_gpus: float, option: str) -> None:
    """Refuse per-client resources that no live node can hold: Flower's actor pool would be empty."""
    if not any(
        node.resources.get("CPU", 0.0) >= num_cpus and node.resources.get("GPU", 0.0) >= num_gpus for node in nodes
    ):
        largest = max(nodes, key=lambda node: (node.resources.get("GPU", 0.0), node.resources.get("CPU", 0.0)))
        raise ConfigError(
            f"{option}: a client needs {num_cpus:g} CPUs and {num_gpus:g} GPUs, and no live node of "
            f"the Ray cluster has them (the largest has {largest.resources.get('CPU', 0.0):g} CPUs, "
            f"{largest.resources.get('GPU', 0.0):g} GPUs); ask for less per client or add a node"
        )


def attach_to_cluster(address: str, option: str, client_cpus: float, client_gpus: float) -> str:
    """Check the cluster at ``address`` answers and can hold a client; returns its resolved ``host:port`` (the
    address unchanged where Ray's internals that check it are not there as read: the seam warns)."""
    if not seam.usable(UNCHECKED, RESOLVE, GCS_CLIENT, NODE_INFO):
        return address
    resolved, nodes = check_ray_address(address, option)
    check_client_fits(nodes, client_cpus, client_gpus, option)
    print(f"[alignfl] {describe_cluster(resolved, nodes)}", flush=True)
    return resolved
