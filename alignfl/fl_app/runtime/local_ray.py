"""A Ray cluster of several nodes on this one machine, for tests and benchmarks of runs on a cluster.

Each node is a ``ray start`` of its own: the head with its own temp dir, and further nodes joined to it, each
with a custom resource that names it (``node0``, ``node1``, ...) and free ports for everything Ray listens on,
so that other Ray instances on the same machine are left alone. ``ray start`` runs in a session of its own and
its daemons (GCS, raylet, agents, and the workers a raylet starts later) stay in that session: each node is a
:class:`alignfl.fl_app.runtime.processes.ProcessTree`, stopped by process id (never ``ray stop``, which stops every Ray
process on the machine), also when the block raises or a stop signal arrives.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from alignfl.fl_app.locations import process_folder
from alignfl.fl_app.runtime.common import free_port
from alignfl.fl_app.runtime.processes import ProcessTree, log_tail, start_process, stop_processes
from alignfl.fl_app.runtime.ray_cluster import RayNode, cluster_nodes

START_TIMEOUT_S = 90.0
OBJECT_STORE_BYTES = 200 * 1024**2
"""Each node's object store: Ray's default is 30 % of the machine's memory per node."""
STOP_GRACE_S = 2.0
"""Seconds between SIGTERM and SIGKILL when the cluster stops: Ray's GCS server and runtime-env agents do not
exit on SIGTERM (Ray 2.55), so a longer grace only waits; the cluster is thrown away with its temp dir."""


def _ray_cli() -> str:
    return str(Path(sys.executable).parent / "ray")


def _ports(head: bool) -> list[str]:
    """Free ports for everything a node listens on (Ray's defaults collide with any other Ray on the machine)."""
    flags = [
        "--node-manager-port",
        "--object-manager-port",
        "--metrics-export-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
    ]
    if head:
        flags += ["--ray-client-server-port", "--dashboard-port"]
    return [item for flag in flags for item in (flag, str(free_port()))]


@dataclass
class LocalRayCluster:
    """A head and the nodes joined to it, on this machine; node ``i`` holds the custom resource ``node<i>``."""

    temp_dir: Path
    port: int
    trees: list[ProcessTree] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_node(
        self, num_cpus: int, object_store_bytes: int = OBJECT_STORE_BYTES, hidden: Sequence[Path] = ()
    ) -> ProcessTree:
        """Start the head (first call) or one more node joined to it; returns once it is up. ``hidden``: folders
        this node's processes see empty (an empty folder mounted over each, in a mount namespace of the node's
        own: root only), as on a machine that lacks them."""
        index = len(self.trees)
        head = index == 0
        command = [
            _ray_cli(),
            "start",
            "--num-cpus",
            str(num_cpus),
            "--num-gpus",
            "0",
            "--resources",
            f'{{"node{index}": 1}}',
            "--object-store-memory",
            str(object_store_bytes),
            "--disable-usage-stats",
            *_ports(head),
        ]
        command += (
            ["--head", "--port", str(self.port), "--temp-dir", str(self.temp_dir), "--include-dashboard=false"]
            if head
            else ["--address", self.address]
        )
        if hidden:
            empty = self.temp_dir / "empty"
            empty.mkdir(exist_ok=True)
            mounts = " && ".join(f"mount --bind {shlex.quote(str(empty))} {shlex.quote(str(path))}" for path in hidden)
            command = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                f'{mounts} && exec "$@"',
                "sh",
                *command,
            ]
        env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        log = self.temp_dir / f"ray-start-node{index}.log"
        with log.open("w") as stream:
            tree = start_process(command, env, process_folder(), stdout=stream, stderr=subprocess.STDOUT)
        self.trees.append(tree)
        deadline = time.monotonic() + START_TIMEOUT_S
        while tree.process.poll() is None:  # its daemons are found while `ray start` still leads their session
            tree.refresh()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"`ray start` for node{index} did not finish in {START_TIMEOUT_S:.0f} s:\n{log_tail(log)}"
                )
            time.sleep(0.1)
        tree.refresh()
        if tree.process.returncode != 0:
            raise RuntimeError(f"`ray start` for node{index} failed:\n{log_tail(log)}")
        return tree

    def nodes(self) -> dict[str, RayNode]:
        """``node<i>`` → that live node."""
        return {
            name: node
            for node in cluster_nodes(self.address)
            for name in node.resources
            if name.startswith("node") and name[4:].isdigit()
        }

    def kill_raylet(self, index: int) -> int:
        """SIGKILL node ``index``'s raylet, as when its machine is lost; returns the pid killed."""
        for pid in self.trees[index].refresh():
            try:
                executable = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if executable.endswith(b"/raylet"):
                os.kill(pid, signal.SIGKILL)
                return pid
        raise RuntimeError(f"node{index} has no raylet running")

    def stop(self) -> None:
        """Stop every process of every node by pid (nodes that joined first), and remove the temp dir."""
        stop_processes(list(reversed(self.trees)), grace_s=STOP_GRACE_S)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@contextmanager
def local_ray_cluster(
    cpus_per_node: list[int], hidden: dict[int, Sequence[Path]] | None = None
) -> Iterator[LocalRayCluster]:
    """A cluster of ``len(cpus_per_node)`` nodes on this machine (node 0 the head), stopped after the block;
    ``hidden``: node index → folders that node sees empty."""
    # Ray's socket paths live under the temp dir and must stay short (108 bytes in all).
    cluster = LocalRayCluster(Path(tempfile.mkdtemp(prefix="alfl-ray-", dir="/tmp")), free_port())
    try:
        for index, cpus in enumerate(cpus_per_node):
            cluster.start_node(cpus, hidden=(hidden or {}).get(index, ()))
        yield cluster
    finally:
        cluster.stop()
