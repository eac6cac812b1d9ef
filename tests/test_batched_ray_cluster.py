"""The batched engine's Ray workers on a real two-node cluster: both nodes train, and a node lost mid-run drops
its clients with a reason naming it while the run goes on on the other node.

The cluster is a head and a second raylet on this machine (:mod:`alignfl.fl_app.runtime.local_ray`), stopped by process
id when the module is done, also when a test fails.
"""

from __future__ import annotations

import json

import pytest

from alignfl.fl_app.engines.batched import run_batched
from alignfl.fl_app.engines.grid import RayOptions
from tests.ray_clusters import cluster_left_clean, kill_node_after_round_1

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with cluster_left_clean([1, 1]) as started:
        yield started


def test_a_node_lost_mid_run_drops_its_clients_naming_it_and_the_other_node_trains_the_rest(cluster, tmp_path):
    nodes = cluster.nodes()
    lost = nodes["node1"]
    metrics = tmp_path / "lost" / "metrics.jsonl"
    killer, killed = kill_node_after_round_1(cluster, metrics)
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
    named = f"Ray node {lost.node_id} ({lost.address.rpartition(':')[0]})"  # its id and address
    assert all(named in reason for reason in loss["clients-dropped-reasons"].values())
    after = [row for row in rows if row["round"] > loss["round"]]
    assert after and all(row["clients-trained"] == 4 for row in after)
    assert all({c["node-id"] for c in row["client-ray-nodes"].values()} == {nodes["node0"].node_id} for row in after)
