"""The warm ClientApp executor without a SuperNode: its children run stand-ins for Flower's runner
(tests/warm_targets.py) that report what they see, raise, exit at once or hang; the parent keeps serving,
a killed parent takes its children with it and is replaced, a parent that cannot start hands its tasks to
Flower's executor, and the entry point falls back to Flower's SuperExec where it is not checked. The same
deployment run with this executor and with Flower's is compared in tests/test_deploy_loopback.py."""

import functools
import importlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResult, LaunchResultStatus

from alignfl.fl_app.config import default_run_config
from alignfl.fl_app.patches import seam, warm_superexec
from alignfl.fl_app.patches.warm_executor import WarmExecutor

TIMEOUT_S = 120.0
MESSAGE_TIMEOUT_S = 6.0


def spec(task_id: int, token: str, task_type: TaskType = TaskType.CLIENT_APP) -> ExecutionSpec:
    return ExecutionSpec(
        task_type=task_type,
        runtime_api_address="127.0.0.1:9",
        token=token,
        insecure=True,
        root_certificates_path=None,
        runtime_dependency_install=False,
        parent_pid=os.getpid(),
        suppress_output=False,
        task_id=task_id,
    )


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(executor: WarmExecutor, condition, what: str, timeout_s: float = TIMEOUT_S) -> None:
    """Read the executor's events until ``condition`` holds."""
    deadline = time.monotonic() + timeout_s
    while executor.reconcile() or not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def executor() -> Iterator[WarmExecutor]:
    """One warm parent (the default app, alignfl.fl_app.client_app: torch, Flower and the project's dependencies) whose
    children run tests/warm_targets.py; the parent-killing test goes last."""
    running = WarmExecutor(["--target", "tests.warm_targets:act", "--message-timeout", str(MESSAGE_TIMEOUT_S)])
    try:
        yield running
    finally:
        running.close()


def test_children_that_raise_exit_or_hang_are_reported_and_the_parent_keeps_serving(executor, tmp_path):
    for task_id, token in [(1, "raise"), (2, "exit:3"), (3, "hang")]:
        assert executor.launch(spec(task_id, token)).status == LaunchResultStatus.ACCEPTED
    wait_for(executor, lambda: 3 in executor.children, "the hanging child")
    executor.launch(spec(4, f"report:{tmp_path / 'after.json'}"))  # served while task 3 hangs
    assert executor.wait_idle(TIMEOUT_S)
    assert executor.outcomes == {1: "code 1", 2: "code 3", 3: "signal SIGKILL", 4: "code 0"}
    assert list(executor.outcomes).index(4) < list(executor.outcomes).index(3)  # done before the hang was killed
    assert (tmp_path / "after.json").exists()


def test_each_child_starts_as_a_fresh_process_would(executor, tmp_path):
    """Its own random state, and the app's own packages not imported (it imports them from the FAB), while the
    third-party ones are."""
    for task_id in (10, 11):
        executor.launch(spec(task_id, f"report:{tmp_path / f'{task_id}.json'}"))
    assert executor.wait_idle(TIMEOUT_S)
    first, second = (json.loads((tmp_path / f"{task_id}.json").read_text()) for task_id in (10, 11))
    assert first["torch"] != second["torch"] and first["numpy"] != second["numpy"]
    assert first["project"] == second["project"] == [] and first["torch-imported"]
    assert first["ppid"] == second["ppid"] == executor.parent.process.pid
    assert executor.outcomes[10] == executor.outcomes[11] == "code 0"


def test_killing_the_parent_stops_its_children_and_a_new_parent_serves_the_next_message(executor, tmp_path, caplog):
    executor.launch(spec(20, "hang"))
    wait_for(executor, lambda: 20 in executor.children, "the hanging child")
    child, parent = executor.children[20], executor.parent.process
    parent.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while alive(child):  # the kernel's SIGTERM (PR_SET_PDEATHSIG), not the executor, stops it
        assert time.monotonic() < deadline, "the child outlived its parent by 10 s"
        time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        executor.launch(spec(21, f"report:{tmp_path / 'new.json'}"))
    assert f"warm ClientApp parent (pid {parent.pid}) exited" in caplog.text
    assert executor.wait_idle(TIMEOUT_S) and executor.outcomes[21] == "code 0"
    assert json.loads((tmp_path / "new.json").read_text())["ppid"] == executor.parent.process.pid != parent.pid


class Recorder:
    """Stands in for Flower's executor: records what it is asked to launch."""

    def __init__(self) -> None:
        self.launched: list[int] = []
        self.closed = False

    def get_eligible_capacity(self, supported_task_types, *, insecure=False, root_certificates_path=None):
        return supported_task_types, set()

    def wait_for_capacity(self, task_type=None, *, fab_hash=None, insecure=False, root_certificates_path=None):
        return None

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        self.launched.append(spec.task_id)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


def test_other_task_types_and_everything_after_a_parent_that_cannot_start_go_to_flowers_executor(caplog):
    flower = Recorder()
    executor = WarmExecutor(["--target", "no_such_module:run"], fallback=flower)
    try:
        executor.launch(spec(1, "t", TaskType.SERVER_APP))
        assert flower.launched == [1]
        with caplog.at_level(logging.WARNING, logger="flwr"):
            executor.launch(spec(2, "t"))  # written to the parent, which exits: then Flower's executor gets it
            wait_for(executor, lambda: executor.given_up, "the executor to give up on its parent")
        assert "exited (code 1) before it was ready; Flower's own executor" in caplog.text
        assert flower.launched == [1, 2]
        executor.launch(spec(3, "t"))
        assert flower.launched == [1, 2, 3]
    finally:
        executor.close()
    assert flower.closed


@pytest.fixture
def flower_loop(monkeypatch):
    """Flower's SuperExec loop module, its get_executor restored after the test, and flower_superexec
    replaced by a stand-in that records the arguments it would parse."""
    loop = importlib.import_module(seam.INTERNALS[warm_superexec.GET_EXECUTOR].module)
    monkeypatch.setattr(loop, "get_executor", seam.get(warm_superexec.GET_EXECUTOR))
    calls = []
    monkeypatch.setattr(warm_superexec, "flower_superexec", lambda: calls.append(list(warm_superexec.sys.argv)))
    monkeypatch.setattr(warm_superexec.sys, "argv", ["python"])
    return loop, calls


def test_the_entry_point_installs_the_warm_executor_and_passes_flowers_arguments_on(flower_loop):
    loop, calls = flower_loop
    warm_superexec.main(["--message-timeout", "60", "--runtime-api-address", "127.0.0.1:9094", "--insecure"])
    assert calls == [["flower-superexec", "--runtime-api-address", "127.0.0.1:9094", "--insecure"]]
    installed = loop.get_executor
    assert isinstance(installed, functools.partial) and installed.func is warm_superexec.warm_get_executor
    assert installed.args[1] == ["--app", "alignfl.fl_app.client_app", "--message-timeout", "60.0"]


@pytest.mark.parametrize(
    "flower_version, argv, reason",
    [
        ("9.9.9", [], "Flower 9.9.9 is not a release alignfl was checked against"),
        ("1.42.0", ["--executor", "kubernetes"], "--executor kubernetes was asked for"),
    ],
)
def test_the_entry_point_runs_flowers_superexec_unchanged_where_it_is_not_checked(
    flower_loop, monkeypatch, caplog, flower_version, argv, reason
):
    loop, calls = flower_loop
    flower_get_executor = loop.get_executor
    monkeypatch.setattr(seam, "release", lambda package: flower_version)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        warm_superexec.main(["--runtime-api-address", "127.0.0.1:9094", "--insecure", *argv])
    assert loop.get_executor is flower_get_executor and len(calls) == 1
    assert (
        f"warm ClientApp processes are off; Flower's own executor starts a fresh flwr-clientapp process per message: {reason}"
        in caplog.text
    )


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf"])
def test_the_entry_point_refuses_a_bad_message_timeout(value, capsys):
    with pytest.raises(SystemExit) as exit:
        warm_superexec.main(["--message-timeout", value, "--runtime-api-address", "127.0.0.1:9094"])
    assert exit.value.code == 2
    assert f"--message-timeout: {value!r} is not allowed: seconds > 0, or 'none'" in capsys.readouterr().err


def test_the_message_timeout_defaults_to_round_timeouts_default():
    """Declared beside the SuperExec (which must not import torch to read it); kept equal here."""
    assert default_run_config()["round-timeout"] == warm_superexec.DEFAULT_MESSAGE_TIMEOUT_S
