"""What Flower's simulation starts from, built from Flower's internals for the tests and benchmarks of
:mod:`alignfl.fl_app.patches.flower_runtime` (the app itself never builds one: the simulation does)."""

from __future__ import annotations

from flwr.proto.task_pb2 import Task  # pylint: disable=no-name-in-module
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import InMemoryLinkState, LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid


def simulation_state(num_nodes: int) -> tuple[InMemoryGrid, InMemoryLinkState, list[int]]:
    """An in-memory state with one run and ``num_nodes`` registered nodes (their ids in partition order, as the
    simulation registers them), and the ServerApp's grid on it."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    assert isinstance(state, InMemoryLinkState)
    run = Run.create_empty(run_id=1)
    run.primary_task_id, run.federation_id = 1, NOOP_FEDERATION_ID
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[1] = Task(task_id=1, run_id=run.run_id)
    nodes = list(_register_nodes(num_nodes, factory))
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return grid, state, nodes
