"""The batched engine's Ray workers on a real two-node cluster: both nodes train, and a node lost mid-run drops
its clients with a reason naming it while the run goes on on the other node.

The cluster is a head and a second raylet on this machine (:mod:`fl_app.runtime.local_ray`), stopped by process id
when the module is done, also when a test fails.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from fl_app.engines.batched import run_batched
from fl_app.engines.grid import RayOptions
from fl_app.runtime.local_ray import local_ray_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with local_ray_cluster([1, 1]) as started:
        temp_dir = str(started.temp_dir)
        yield started
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, temp_dir)]
    assert not left, f"processes of the test's Ray cluster are left: {left}"


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_a_node_lost_mid_run_drops_its_clients_naming_it_and_the_other_node_trains_the_rest(cluster, tmp_path):
    nodes = cluster.nodes()
    lost = nodes["node1"]
    metrics = tmp_path / "lost" / "metrics.jsonl"
    killed: list[int] = []

    def kill_after_round_1() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if metrics.exists() and any(json.loads(line)["round"] == 1 for line in metrics.read_text().splitlines()):
                killed.append(cluster.kill_raylet(1))
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_round_1, daemon=True)
    killer.start()
    values = {
        "dataset": "digits",
        "num-server-rounds": 4,
        "evaluate-every": 100,
        "results-dir": str(tmp_path),
        "run-name": "lost",
        "device": "cpu",
    }
    run_batched(values, 4, vectorise="on", ray=RayOptions(address=cluster.address))
    killer.join(timeout=1)
    assert killed, "round 1 never finished"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1, 2, 3, 4]
    used = {client["node-id"] for client in rows[1]["client-ray-nodes"].values()}
    assert used == {nodes["node0"].node_id, lost.node_id}  # the workers were spread over both nodes
    losing = [row for row in rows[2:] if row["clients-dropped"]]
    assert len(losing) == 1, [row["clients-dropped-reasons"] for row in rows]
    (loss,) = losing
    assert loss["clients-trained"] == 4 - loss["clients-dropped"] >= 1
    assert all(f"Ray node {lost.node_id}" in reason for reason in loss["clients-dropped-reasons"].values())
    after = [row for row in rows if row["round"] > loss["round"]]
    assert after and all(row["clients-trained"] == 4 for row in after)
    assert all({c["node-id"] for c in row["client-ray-nodes"].values()} == {nodes["node0"].node_id} for row in after)
