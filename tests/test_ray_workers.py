"""The batched engine's Ray worker pool against stand-in actors (no Ray started): a worker that dies at placement
(a node Ray still lists though it was just lost) or is never placed leaves the pool before round 0 and the run
goes on; a worker lost mid-run drops its clients with a reason naming its node's id and address."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

from alignfl.fl_app.engines import ray_workers
from alignfl.fl_app.engines.batched import run_batched
from alignfl.fl_app.engines.grid import RayOptions
from alignfl.fl_app.engines.worker import Worker

NODE = {"node-id": "4e0de1", "address": "10.231.9.4"}
LOST = {"node-id": "dead0c", "address": "10.231.9.5"}


class Ref:
    """A stand-in object ref: ``value()`` gives the result or raises; None never becomes ready."""

    def __init__(self, value: Callable[[], Any] | None) -> None:
        self.value = value


class Method:
    def __init__(self, call: Callable[..., Any] | None) -> None:
        self.call = call

    def remote(self, *args: Any) -> Ref:
        return Ref(None if self.call is None else lambda: self.call(*args))


def died(*_: Any) -> Any:
    raise ray.exceptions.ActorDiedError()


class Actor:
    """A worker actor whose fate is ``placed`` (on NODE), ``died`` (at placement), ``pending`` (never placed) or
    ``lost`` (placed on LOST, whose node dies after its first call: the nodes' partition query)."""

    def __init__(self, fate: str, overrides: dict, vectorise: bool) -> None:
        self.fate, self.killed, self.ran = fate, False, 0
        self.worker = Worker(overrides, vectorise) if fate in ("placed", "lost") else None
        where = {"placed": lambda: NODE, "lost": lambda: LOST, "died": died, "pending": None}[fate]
        self.placement = Method(where)
        self.run = Method(self._run)

    def _run(self, jobs: list) -> list:
        if self.fate == "lost" and self.ran:
            died()
        self.ran += len(jobs)
        replies = self.worker.run(jobs)
        return [(reply, context.state) for reply, (_, context) in zip(replies, jobs, strict=True)]


class ActorClass:
    """Stands in for ``WorkerActor``: each ``remote`` makes the next actor of ``fates``."""

    def __init__(self, fates: list[str]) -> None:
        self.fates, self.made = list(fates), []

    def options(self, **_: Any) -> ActorClass:
        return self

    def remote(self, overrides: dict, vectorise: bool, _threads: int) -> Actor:
        self.made.append(Actor(self.fates.pop(0), overrides, vectorise))
        return self.made[-1]


class FakeRay:
    """The few calls of Ray's API the pool makes; a Ray that is already running."""

    exceptions = ray.exceptions

    def __init__(self, cpus: int) -> None:
        self.cpus = cpus

    def is_initialized(self) -> bool:
        return True

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": float(self.cpus)}

    def wait(self, refs: list[Ref], num_returns: int, timeout: float | None) -> tuple[list[Ref], list[Ref]]:
        return [r for r in refs if r.value is not None], [r for r in refs if r.value is None]

    def get(self, ref: Ref) -> Any:
        return ref.value()

    def kill(self, actor: Actor) -> None:
        actor.killed = True

    def shutdown(self) -> None:
        raise AssertionError("the pool did not start this Ray")


@pytest.fixture
def actors(monkeypatch) -> Callable[[list[str]], ActorClass]:
    """Stand-in actors of the given fates, one per CPU of a stand-in cluster."""

    def make(fates: list[str]) -> ActorClass:
        made = ActorClass(fates)
        monkeypatch.setattr(ray_workers, "ray", FakeRay(len(fates)))
        monkeypatch.setattr(ray_workers, "WorkerActor", made)
        return made

    return make


def _values(tmp_path: Path, rounds: int) -> dict:
    return {
        "dataset": "digits",
        "model": "small-mlp",
        "device": "cpu",
        "num-server-rounds": rounds,
        "data-fraction": 0.2,
        "fraction-train": 1.0,
        "evaluate-every": 100,
        "results-dir": str(tmp_path),
        "run-name": "run",
    }


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_worker_that_dies_at_placement_leaves_the_pool_and_the_run_goes_on(actors, tmp_path):
    made = actors(["died", "placed", "pending"])
    run_batched(_values(tmp_path, 1), 4, vectorise="off", ray=RayOptions(address="10.231.9.1:6379"))
    dead, live, pending = made.made
    assert dead.killed and pending.killed  # stopped, not left pending in Ray
    assert live.ran == 3 * 4  # the nodes' query, training and evaluation messages all went to the live worker
    rows = _rows(tmp_path)
    assert [row["round"] for row in rows] == [0, 1]
    assert rows[1]["clients-trained"] == 4 and rows[1]["clients-dropped"] == 0  # all on the one live worker


def test_the_pool_says_why_a_worker_was_left_out_and_refuses_when_none_is_placed(actors, caplog):
    made = actors(["died", "pending"])
    handles = [made.remote({}, False, 1) for _ in range(2)]
    logging.getLogger("flwr").addHandler(caplog.handler)  # Flower's logger does not propagate
    try:
        with pytest.raises(RuntimeError, match="no Ray worker of the batched engine could be started: one died"):
            ray_workers.place(handles, 7.0)
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
    assert all(actor.killed for actor in handles)
    assert "died before it was placed (ActorDiedError" in caplog.text
    assert "was not placed within 7 s" in caplog.text


def test_a_worker_lost_mid_run_drops_its_clients_naming_its_nodes_id_and_address(actors, tmp_path):
    actors(["placed", "lost"])
    run_batched(_values(tmp_path, 2), 4, vectorise="off", ray=RayOptions(address="10.231.9.1:6379"))
    rows = _rows(tmp_path)
    assert rows[1]["clients-trained"] == 2 and rows[1]["clients-dropped"] == 2
    for reason in rows[1]["clients-dropped-reasons"].values():
        assert f"Ray node {LOST['node-id']} ({LOST['address']})" in reason
    assert rows[2]["clients-trained"] == 4 and rows[2]["clients-dropped"] == 0  # the other worker ran them all
