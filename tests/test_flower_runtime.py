"""The indexed message lookup for Flower's in-memory state answers every lookup as Flower's own does, and is
installed only on the Flower releases it was checked against."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterator

import pytest
from flower_state import simulation_state
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.server.superlink.linkstate import InMemoryLinkState
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation
from flwr.supercore.task_identity import TaskIdentity

from alignfl.core.rounds.nodes import send_and_receive, wait_for_nodes
from alignfl.fl_app import server_app
from alignfl.fl_app.client_app import build_client_app
from alignfl.fl_app.inprocess import InProcessGrid
from alignfl.fl_app.patches import flower_runtime, seam

FLOWER_LOOKUP = seam.get(flower_runtime.LOOKUP)


@pytest.fixture(autouse=True)
def flowers_own_methods(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from Flower's methods and leaves them so (installing the index patches the class)."""
    monkeypatch.setattr(InMemoryLinkState, "store_message_ins", seam.get(flower_runtime.STORE))
    monkeypatch.setattr(InMemoryLinkState, "get_message_ins", FLOWER_LOOKUP)
    for name in ("_task_id", "_run_id", "_node_id"):  # simulation_state's run (a simulation run earlier in this
        monkeypatch.setattr(TaskIdentity, name, 1)  # process leaves its own run id, which that state refuses)
    yield


def labelled(node: int, label: int) -> Message:
    return Message(
        RecordDict({"label": ConfigRecord({"label": label})}), dst_node_id=node, message_type=MessageType.QUERY
    )


def label_of(message: Message) -> int:
    return int(message.content["label"]["label"])  # type: ignore[arg-type]


def test_the_indexed_lookup_answers_every_lookup_as_flowers_does() -> None:
    rng = random.Random(3)
    flower_grid, flower_state, flower_nodes = simulation_state(8)
    flower_runtime.index_message_lookup()
    indexed_grid, indexed_state, indexed_nodes = simulation_state(8)
    sides = [
        (flower_grid, flower_state, flower_nodes, FLOWER_LOOKUP),
        (indexed_grid, indexed_state, indexed_nodes, flower_runtime.get_message_ins),
    ]
    answers: list[list[tuple[int, ...]]] = [[], []]
    label, answered = 0, []  # labels pushed so far; labels delivered and not yet deleted (oldest first)
    for _ in range(300):
        action, node, limit = rng.random(), rng.randrange(8), rng.choice([1, 1, 2, None])
        if action < 0.35:  # the server sends a message to a node (some nodes get several before asking)
            label += 1
        expiring = rng.randint(1, max(label, 1))
        pulled = answered[:2] if 0.45 <= action < 0.6 else []
        answered = answered[len(pulled) :]
        for side, (grid, state, nodes, lookup) in enumerate(sides):
            by_label = {label_of(message): message_id for message_id, message in state.message_ins_store.items()}
            if action < 0.35:
                assert len(list(grid.push_messages([labelled(nodes[node], label)]))) == 1
            elif action < 0.45 and expiring in by_label:  # one stored message expires
                state.message_ins_store[by_label[expiring]].metadata.__dict__["_created_at"] = 0.0
            elif action < 0.6:  # replies came and the server pulled them: it deletes their messages
                state.delete_messages({by_label[done] for done in pulled if done in by_label})
            else:
                found = [label_of(message) for message in lookup(state, nodes[node], limit)]
                answers[side].append((node, *found))
        if action >= 0.6:
            answered += answers[0][-1][1:]
    assert answers[0] == answers[1]
    assert sum(len(answer) > 1 for answer in answers[0]) > 30  # lookups found messages, not only empty queues
    assert any(len(answer) > 2 for answer in answers[0])  # and several for one node at once


def test_an_expired_message_is_deleted_when_its_node_asks() -> None:
    flower_runtime.index_message_lookup()
    grid, state, nodes = simulation_state(3)
    [message_id] = grid.push_messages([labelled(nodes[1], 7)])
    state.message_ins_store[message_id].metadata.__dict__["_created_at"] = 0.0
    assert state.get_message_ins(nodes[1], limit=1) == []
    assert message_id not in state.message_ins_store


def test_the_lookup_refuses_a_limit_below_one_as_flowers_does() -> None:
    _, state, nodes = simulation_state(1)
    with pytest.raises(AssertionError, match="limit"):
        flower_runtime.get_message_ins(state, nodes[0], 0)


def test_installing_patches_the_class_once_on_a_checked_flower() -> None:
    assert flower_runtime.index_message_lookup()
    assert InMemoryLinkState.get_message_ins is flower_runtime.get_message_ins
    assert InMemoryLinkState.store_message_ins is flower_runtime.store_message_ins
    assert flower_runtime.index_message_lookup()


def test_an_unchecked_flower_keeps_its_own_lookup(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(seam, "release", lambda package: "9.9.9")
    assert not flower_runtime.index_message_lookup()
    grid, _, _ = simulation_state(2)
    assert flower_runtime.prepare_simulation(grid) is None  # every node will be asked
    assert InMemoryLinkState.get_message_ins is FLOWER_LOOKUP
    assert "Flower 9.9.9 is not a release alignfl was checked against" in caplog.text


@pytest.mark.parametrize("key", flower_runtime.PATCH.needs)
def test_a_flower_without_one_of_its_internals_falls_back_with_the_warning(
    key: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Flower release that moved one of the private modules the lookup uses: the ServerApp's simulation path
    keeps Flower's own lookup, warns, and asks every node."""
    grid, _, _ = simulation_state(3)
    internal = seam.INTERNALS[key]
    monkeypatch.setitem(seam.INTERNALS, key, dataclasses.replace(internal, module=f"{internal.module}_moved"))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert not flower_runtime.index_message_lookup()
        assert server_app.prepare_simulation(grid) is None  # what the ServerApp calls
    assert InMemoryLinkState.get_message_ins is FLOWER_LOOKUP  # Flower's own lookup stays
    assert "simulation keeps its own message lookup" in caplog.text
    assert f"{internal.module}_moved does not import" in caplog.text


def test_only_a_simulation_grid_gets_a_partition_table() -> None:
    assert flower_runtime.prepare_simulation(InProcessGrid(build_client_app(), 2)) is None  # type: ignore[arg-type]
    grid, _, nodes = simulation_state(5)
    table = flower_runtime.prepare_simulation(grid)
    assert table is not None and table() == {node: partition for partition, node in enumerate(nodes)}


def test_a_server_app_loads_flowers_simulation_state_only_in_a_simulation() -> None:
    import subprocess
    import sys

    code = "import sys, alignfl.fl_app.server_app; print('flwr.server.superlink.linkstate' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@pytest.mark.long
def test_the_partition_table_agrees_with_what_each_simulated_node_says() -> None:
    """Flower's simulation through Ray: the table read from its state gives every node the partition that the
    node's own config holds. Long (Ray's start-up): in CI the table is read from Flower's state of an in-process
    simulation (above), and in every Ray simulation the round runner checks one node's answer against it, asking
    every node instead where they differ (tests/test_end_to_end.py, tests/test_sweep_runs.py)."""
    seen: list[tuple[dict[int, int], dict[int, int]]] = []
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        wait_for_nodes(grid, 7, timeout=60.0)
        table = flower_runtime.prepare_simulation(grid)
        assert table is not None
        queries = [
            Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in grid.get_node_ids()
        ]
        replies = send_and_receive(grid, queries, timeout=60.0)
        said = {
            reply.metadata.src_node_id: int(reply.content["metrics"]["partition-id"])  # type: ignore[arg-type]
            for reply in replies
        }
        seen.append((table(), said))

    run_simulation(
        server_app=server,
        client_app=build_client_app(),
        num_supernodes=7,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    [(table, said)] = seen
    assert len(said) == 7 and table == said
