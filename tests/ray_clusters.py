"""A two-node Ray cluster on this machine for the cluster tests, and a raylet killed mid-run."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alignfl.fl_app.runtime.local_ray import LocalRayCluster, local_ray_cluster


@contextmanager
def cluster_left_clean(cpus: list[int], **options: Any) -> Iterator[LocalRayCluster]:
    """:func:`local_ray_cluster`; afterwards, asserts that no process of it is left."""
    with local_ray_cluster(cpus, **options) as started:
        temp_dir = str(started.temp_dir)
        yield started
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, temp_dir)]
    assert not left, f"processes of the test's Ray cluster are left: {left}"


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def kill_node_after_round_1(cluster: LocalRayCluster, metrics: Path) -> tuple[threading.Thread, list[int]]:
    """A started thread that kills the second node's raylet once ``metrics`` holds round 1 (within 300 s), and
    the list its killed pid goes to."""
    killed: list[int] = []

    def kill() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if metrics.exists() and any(json.loads(line)["round"] == 1 for line in metrics.read_text().splitlines()):
                killed.append(cluster.kill_raylet(1))
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer, killed
