"""Simulations on a running Ray cluster: the address checked first, where clients ran, a node lost mid-run.

The slow tests start a real two-node cluster on this machine (:mod:`alignfl.fl_app.runtime.local_ray`: a head and a
second raylet joined to it, each with its own custom resource, own temp dir and free ports) and stop exactly its
processes, by pid, when the module is done, also when a test fails.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.config import ConfigError, parse_run_config
from alignfl.fl_app.inprocess import InProcessGrid
from alignfl.fl_app.results import RAY_NODE_RECORD, _ray_nodes
from alignfl.fl_app.runtime import launch
from alignfl.fl_app.runtime.common import free_port
from alignfl.fl_app.runtime.ray_cluster import RayNode, check_client_fits, check_ray_address
from alignfl.fl_app.sweeps.sim import SimSettings
from alignfl.fl_app.sweeps.sweep import register_configs, run_job
from tests.ray_clusters import cluster_left_clean, kill_node_after_round_1
from tests.sweep_jobs import composed, sweep
from tests.test_data import write_mnist_raw

TINY_DIGITS = {"dataset": "digits", "num-server-rounds": 1}


# --- before anything starts ----------------------------------------------------------------------------------


def test_an_address_where_no_cluster_answers_is_refused_naming_it_and_how_to_start_one():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ConfigError, match=f"--ray-address='{address}': no Ray cluster answers there") as error:
        check_ray_address(address, "--ray-address")
    assert "ray start --head" in str(error.value) and time.monotonic() - started < 10


def test_the_launcher_refuses_a_dead_ray_address_with_exit_2_before_a_superlink_starts(tmp_path, capsys):
    address = f"127.0.0.1:{free_port()}"
    code = launch.main(
        [
            "--ray-address",
            address,
            "--num-supernodes",
            "2",
            "--run-config",
            f'dataset="digits" results-dir="{tmp_path}"',
        ]
    )
    assert code == 2
    assert f"--ray-address='{address}': no Ray cluster answers there" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no run folder: nothing started


def test_a_sweep_on_a_dead_ray_address_starts_no_job(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    result = sweep(tmp_path, "dataset=digits", f"sim.ray_address={address}", "seed=0,1")
    assert result.returncode != 0
    assert f"invalid sweep, no job was started: sim.ray_address='{address}': no Ray cluster answers" in result.stderr
    assert not list(tmp_path.glob("**/job.json"))


def test_a_client_that_fits_on_no_node_is_refused():
    nodes = [RayNode("a" * 56, "10.0.0.1:1", {"CPU": 2.0}), RayNode("b" * 56, "10.0.0.2:1", {"CPU": 4.0})]
    check_client_fits(nodes, 4, 0, "--num-cpus")
    with pytest.raises(ConfigError, match="a client needs 1 CPUs and 0.5 GPUs, and no live node"):
        check_client_fits(nodes, 1, 0.5, "sim.client_gpus")


def test_attached_jobs_pass_the_address_and_no_resource_counts_to_ray():
    sim = SimSettings.from_config({"backend": "ray", "ray_address": "10.0.0.1:6379", "client_cpus": 2.0})
    assert sim.federation_config() == {
        "num-supernodes": 10,
        "client-resources-num-cpus": 2,
        "client-resources-num-gpus": 0.0,
    }
    assert sim.ray_address == "10.0.0.1:6379"  # joined through RAY_ADDRESS
    with pytest.raises(ConfigError, match=r"\['sim.ray_cpus'\] must be null with sim.ray_address"):
        SimSettings.from_config({"backend": "ray", "ray_address": "auto", "ray_cpus": 4})
    with pytest.raises(ConfigError, match="sim.ray_address = 'auto' needs sim.backend=ray or batched"):
        SimSettings.from_config({"ray_address": "auto", "backend": "inprocess"})
    with pytest.raises(ConfigError, match="'sim.ray_address' = 6379 is not allowed"):
        SimSettings.from_config({"ray_address": 6379})


def test_a_client_lacking_the_data_set_names_its_node_and_the_missing_files(tmp_path, monkeypatch):
    monkeypatch.setattr("alignfl.fl_app.client_app.where_this_runs", lambda: " on Ray node 3f2a (10.0.0.7)")
    values = {"dataset": "mnist", "data-root": str(tmp_path), "num-server-rounds": 1}
    config = parse_run_config(values)
    grid = InProcessGrid(build_client_app(values), 2)
    message = Message(
        RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({**config.pan_signature(), "server-round": 1})}),
        dst_node_id=grid.get_node_ids()[0],
        message_type=MessageType.TRAIN,
    )
    reply = grid.deliver(message)
    assert reply.has_error()
    assert "this node on Ray node 3f2a (10.0.0.7) lacks the data set" in reply.error.reason
    assert str(tmp_path) in reply.error.reason and "train-images-idx3-ubyte" in reply.error.reason


def test_the_round_records_which_ray_node_each_client_trained_on():
    def reply(partition: int, node: str) -> RecordDict:
        return RecordDict(
            {
                "metrics": MetricRecord({"partition-id": partition, "num-examples": 5}),
                RAY_NODE_RECORD: ConfigRecord({"node-id": node, "address": "10.0.0.1"}),
            }
        )

    assert _ray_nodes([reply(2, "bb"), reply(0, "aa"), RecordDict({"metrics": MetricRecord({"partition-id": 1})})]) == {
        "0": {"node-id": "aa", "address": "10.0.0.1"},
        "2": {"node-id": "bb", "address": "10.0.0.1"},
    }


# --- a real two-node cluster ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mnist_root(tmp_path_factory):
    """A small MNIST in torchvision's layout, which the second node of :func:`cluster` does not see."""
    root = tmp_path_factory.mktemp("mnist")
    write_mnist_raw(root / "MNIST" / "raw", n_train=400, n_test=100)
    return root


@pytest.fixture(scope="module")
def cluster(mnist_root):
    """A head (1 CPU, resource ``node0``) and a second node (1 CPU, ``node1``) that lacks ``mnist_root``: one
    ClientApp actor on each; afterwards no process of theirs is left."""
    with cluster_left_clean([1, 1], hidden={1: [mnist_root]}) as started:
        yield started


def _job(cluster, tmp_path: Path, name: str, *overrides: str) -> tuple[dict, list[dict]]:
    """A sweep job, on Flower's Ray engine unless ``overrides`` choose another (the batched engine's workers on a
    cluster: test_batched_ray_cluster.py)."""
    register_configs()
    engine = [] if any(o.startswith("sim.backend=") for o in overrides) else ["sim.backend=ray"]
    cfg = composed(["dataset=digits", "sim.num_supernodes=4", "train.evaluate_every=100", *engine, *overrides])
    record = run_job(cfg, cfg.hydra.runtime.choices, tmp_path / name)
    lines = (Path(record["run-folder"]) / "metrics.jsonl").read_text().splitlines() if record["run-folder"] else []
    return record, [json.loads(line) for line in lines]


def _without(rows: list[dict], *keys: str) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in keys} for row in rows]


@pytest.mark.slow
def test_a_node_lacking_the_data_set_fails_its_clients_naming_it_and_the_round_goes_on(cluster, mnist_root, tmp_path):
    lacking = cluster.nodes()["node1"]
    record, rows = _job(
        cluster,
        tmp_path,
        "lacking",
        "dataset=mnist",
        f"data.root={mnist_root}",
        "train.num_server_rounds=2",
        f"sim.ray_address={cluster.address}",
    )
    assert record["status"] == "completed", record["error"]
    reasons = [reason for row in rows[1:] for reason in row["clients-dropped-reasons"].values()]
    assert reasons and all(
        f"on Ray node {lacking.node_id}" in reason
        and "lacks the data set" in reason
        and str(mnist_root / "MNIST" / "raw") in reason
        for reason in reasons
    )
    assert all(row["clients-trained"] == 4 - row["clients-dropped"] >= 1 for row in rows[1:])
    summary = json.loads((Path(record["run-folder"]) / "summary.json").read_text())
    assert sum(summary["dropped-reasons"].values()) == len(reasons)


@pytest.mark.slow
def test_clients_run_on_both_nodes_and_a_node_lost_mid_run_drops_its_messages_naming_it(cluster, tmp_path):
    """Round 1 trains on both nodes and gives the rows of one node (the in-process engine, which gives a one-node
    Ray job's rows: tests/test_sweep_runs.py::test_an_in_process_job_gives_the_metrics_of_a_ray_job). Then the
    second node's raylet is killed: the messages on it are dropped with a reason that names it, its actors leave
    Flower's pool, and every later round trains all four clients on the head. One job checks both (each job starts
    a ClientApp actor on each node)."""
    nodes = cluster.nodes()
    lost = nodes["node1"]
    metrics = tmp_path / "lost" / "run" / "metrics.jsonl"
    killer, killed = kill_node_after_round_1(cluster, metrics)
    started = time.monotonic()
    record, rows = _job(cluster, tmp_path, "lost", "train.num_server_rounds=4", f"sim.ray_address={cluster.address}")
    killer.join(timeout=1)
    assert killed, "round 1 never finished"
    assert record["status"] == "completed", record["error"]
    assert [row["round"] for row in rows] == [0, 1, 2, 3, 4] and time.monotonic() - started < 300
    placed = rows[1]["client-ray-nodes"]
    assert set(placed) == {"0", "1", "2", "3"}
    assert {client["node-id"] for client in placed.values()} == {nodes["node0"].node_id, lost.node_id}
    _, alone = _job(cluster, tmp_path, "one-node", "train.num_server_rounds=4", "sim.backend=inprocess")
    assert _without(rows[:2], "elapsed-s", "client-ray-nodes") == _without(alone[:2], "elapsed-s")
    losing = [row for row in rows[2:] if row["clients-dropped"]]
    assert len(losing) == 1, [row["clients-dropped-reasons"] for row in rows]
    (loss,) = losing
    assert loss["clients-dropped"] in (1, 2) and loss["clients-trained"] == 4 - loss["clients-dropped"]
    assert all(f"Ray node {lost.node_id}" in reason for reason in loss["clients-dropped-reasons"].values())
    after = [row for row in rows if row["round"] > loss["round"]]
    assert after and all(row["clients-trained"] == row["clients-sampled"] == 4 for row in after)
    assert all(
        {c["node-id"] for c in row["client-ray-nodes"].values()} == {cluster.nodes()["node0"].node_id} for row in after
    )
    summary = json.loads((Path(record["run-folder"]) / "summary.json").read_text())
    assert sum(summary["dropped-reasons"].values()) == loss["clients-dropped"]


# --- the actor pool, without a cluster -----------------------------------------------------------------------


class _FakePool:
    """What :mod:`alignfl.fl_app.patches.ray_pool` uses of Flower's ``BasicActorPool``: the idle actors, their count,
    the resources per client, and adding actors."""

    def __init__(self, actors: list[str]) -> None:
        self.pool = list(actors)
        self.num_actors = len(actors)
        self.client_resources = {"num_cpus": 1, "num_gpus": 0.0}
        self.added = 0

    def add_actors_to_pool(self, count: int) -> None:
        self.pool += [f"new{self.added + i}" for i in range(count)]
        self.num_actors += count
        self.added += count


def test_a_lost_actor_and_the_idle_ones_on_its_node_leave_the_pool_and_replacements_fill_the_room(monkeypatch):
    from alignfl.fl_app.patches import ray_pool

    nodes = {"a1": ("ALIVE", "node-a"), "a2": ("ALIVE", "node-a"), "b1": ("DEAD", "node-b"), "b2": ("ALIVE", "node-b")}
    monkeypatch.setattr(ray_pool, "actor_node", lambda actor: (*nodes[actor], "10.0.0.2"))
    pool = _FakePool(["a1", "b2"])  # a2 is busy; b1 failed its message
    pool.num_actors = 4
    assert ray_pool._retire(pool, "b1", "node-b") == 2 and pool.pool == ["a1"]  # b2 was on the lost node
    monkeypatch.setattr("ray.is_initialized", lambda: True)
    monkeypatch.setattr(ray_pool, "_node_dead", lambda node: True)
    monkeypatch.setattr(ray_pool, "pool_size", lambda resources: 3)  # a node with room joined
    ray_pool._replace(pool, "node-b")
    assert pool.added == 1 and pool.num_actors == 3 and pool.pool == ["a1", "new0"]


def test_a_message_waits_for_an_idle_actor_and_fails_at_once_when_none_is_left():
    from alignfl.fl_app.patches import ray_pool

    pool = _FakePool([])
    pool.num_actors = 1  # one actor, busy
    taken: list[str] = []
    waiter = threading.Thread(target=lambda: taken.append(ray_pool._take_actor(pool)))
    waiter.start()
    time.sleep(0.3)
    assert not taken
    ray_pool._give_back(pool, "a1")
    waiter.join(timeout=5)
    assert taken == ["a1"]
    pool.num_actors = 0
    with pytest.raises(ray_pool.RayNodeLost, match="no ClientApp actor is left"):
        ray_pool._take_actor(pool)
