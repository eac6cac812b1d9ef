"""A SuperExec executor that hands each ClientApp task to a warm parent process
(:mod:`alignfl.fl_app.patches.warm_parent`).

Flower's SuperExec (1.41, 1.42) separates what to run from how: its loop acquires a task from the Runtime API and asks
an executor (``flwr.supercore.superexec.executor.Executor``) to launch it from an ``ExecutionSpec``. Flower's
``SubprocessExecutor`` starts ``flwr-clientapp`` afresh; :class:`WarmExecutor` writes the spec to its warm
parent, which forks a child for it, and reads back what became of each child (started, killed past the
timeout, ended with its exit code and CPU-seconds) into the SuperExec's log. Task types other than the
ClientApp's go to Flower's executor.

The parent is started with the executor, so it is warm before the first message. One that dies is started
again, and the tasks it had not forked yet are sent to the new one (their tokens are still valid); the
children it had forked get SIGTERM from the kernel as it dies. A parent that never becomes ready (it cannot
start or import its runner) is not tried again: the executor warns and hands every later task, and those
waiting, to Flower's own executor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from logging import DEBUG, INFO, WARNING
from typing import Any

from flwr.common.logger import log

from alignfl.fl_app.patches import seam

TASK_TYPE = "flwr.supercore.constant.TaskType"
SUBPROCESS_EXECUTOR = "flwr.supercore.superexec.executor.SubprocessExecutor"
LAUNCH_RESULT = "flwr.supercore.superexec.executor.LaunchResult"
NEEDS = (TASK_TYPE, SUBPROCESS_EXECUTOR, LAUNCH_RESULT)
"""The Flower internals this executor uses (:mod:`alignfl.fl_app.patches.warm_superexec` installs it through the
seam)."""
Executor = Any
"""Flower's ``flwr.supercore.superexec.executor.Executor`` protocol (get_eligible_capacity, wait_for_capacity,
launch, reconcile, close)."""
ExecutionSpec = Any
"""Flower's ``flwr.supercore.superexec.executor.ExecutionSpec``: a dataclass of one task's launch arguments."""
LaunchResult = Any
PARENT_MODULE = "alignfl.fl_app.patches.warm_parent"
STOP_GRACE_S = 15.0


class ParentProcess:
    """One warm parent: the process, its two pipes and the events read so far."""

    def __init__(self, options: Sequence[str]) -> None:
        requests_r, self.requests = os.pipe()
        self.events, events_w = os.pipe()
        os.set_blocking(self.events, False)
        command = [
            sys.executable,
            "-m",
            PARENT_MODULE,
            "--requests-fd",
            str(requests_r),
            "--events-fd",
            str(events_w),
            *options,
        ]
        try:
            self.process = subprocess.Popen(command, pass_fds=(requests_r, events_w), stdin=subprocess.DEVNULL)
        finally:
            os.close(requests_r)
            os.close(events_w)
        self.ready = False
        self.buffer = b""

    def send(self, spec: ExecutionSpec) -> bool:
        """Write the task; False when the parent is gone."""
        line = json.dumps(dataclasses.asdict(spec)) + "\n"
        try:
            os.write(self.requests, line.encode())
            return True
        except BrokenPipeError:
            return False

    def read_events(self) -> list[dict[str, Any]]:
        """Every complete event line written since the last call."""
        while True:
            try:
                chunk = os.read(self.events, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def stop(self) -> None:
        """Close its input (it stops its children and exits); SIGTERM, then SIGKILL if it lingers."""
        if self.requests >= 0:
            os.close(self.requests)
            self.requests = -1
        for signum in (None, signal.SIGTERM, signal.SIGKILL):
            if signum is not None and self.process.poll() is None:
                self.process.send_signal(signum)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
                break
            except subprocess.TimeoutExpired:
                continue
        os.close(self.events)


class WarmExecutor:
    """Flower's ``Executor`` protocol: ClientApp tasks go to a warm parent, anything else to ``fallback``."""

    def __init__(self, options: Sequence[str] = (), fallback: Executor | None = None) -> None:
        """``options``: :mod:`alignfl.fl_app.patches.warm_parent`'s command-line options (``--app``,
        ``--message-timeout``, ``--target``). ``fallback``: Flower's own executor unless given."""
        self.options = list(options)
        self.fallback: Executor = fallback if fallback is not None else seam.get(SUBPROCESS_EXECUTOR)()
        self.pending: dict[int, ExecutionSpec] = {}
        """Tasks sent to the parent that it has not forked yet."""
        self.outcomes: dict[int, str] = {}
        """Task id → how its child ended (``code 0``, ``signal SIGKILL``, ``refused: ...``)."""
        self.cpu_s: dict[int, float] = {}
        """Task id → CPU-seconds its child used (user + system, from ``wait4``)."""
        self.children: dict[int, int] = {}
        """Task id → its child's pid, while it runs."""
        self.given_up = False
        self.parent: ParentProcess | None = ParentProcess(self.options)

    def get_eligible_capacity(
        self, supported_task_types: set[Any], *, insecure: bool = False, root_certificates_path: str | None = None
    ) -> tuple[set[Any], set[str]]:
        """Like Flower's subprocess executor: every task type, no wait."""
        return self.fallback.get_eligible_capacity(
            supported_task_types, insecure=insecure, root_certificates_path=root_certificates_path
        )

    def wait_for_capacity(
        self,
        task_type: Any = None,
        *,
        fab_hash: str | None = None,
        insecure: bool = False,
        root_certificates_path: str | None = None,
    ) -> None:
        self.fallback.wait_for_capacity(
            task_type, fab_hash=fab_hash, insecure=insecure, root_certificates_path=root_certificates_path
        )

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        """A ClientApp task to the warm parent (it forks at once once ready); others to Flower's executor."""
        if spec.task_type != seam.get(TASK_TYPE).CLIENT_APP or self.given_up:
            return self.fallback.launch(spec)
        self.reconcile()  # a parent that died is replaced before the task is written
        if self.given_up or self.parent is None:
            return self.fallback.launch(spec)
        self.pending[spec.task_id] = spec
        if not self.parent.send(spec):
            self.reconcile()
        return seam.get(LAUNCH_RESULT).accepted()

    def reconcile(self) -> None:
        """Read the parent's events into the log; replace a parent that died (or give up on one that never
        became ready)."""
        parent = self.parent
        if parent is None:
            return
        for event in parent.read_events():
            self.record(event)
        if parent.process.poll() is None:
            return
        for event in parent.read_events():
            self.record(event)
        parent.stop()
        how = parent.process.returncode
        if not parent.ready:
            log(
                WARNING,
                "[alignfl] the warm ClientApp parent exited (code %s) before it was ready; Flower's own "
                "executor starts this node's ClientApp processes from now on",
                how,
            )
            self.given_up, self.parent = True, None
            for spec in self.take_pending():
                self.fallback.launch(spec)
            return
        log(
            WARNING,
            "[alignfl] the warm ClientApp parent (pid %d) exited (code %s); its running ClientApp "
            "processes were stopped with it; starting a new one",
            parent.process.pid,
            how,
        )
        self.children.clear()
        self.parent = ParentProcess(self.options)
        for spec in self.take_pending():
            self.pending[spec.task_id] = spec
            self.parent.send(spec)

    def take_pending(self) -> list[ExecutionSpec]:
        specs = list(self.pending.values())
        self.pending.clear()
        return specs

    def record(self, event: dict[str, Any]) -> None:
        """Log one event of the parent and keep what tests and benchmarks read."""
        kind = event["event"]
        if kind == "ready":
            assert self.parent is not None
            self.parent.ready = True
            log(
                INFO,
                "[alignfl] warm ClientApp parent pid %d ready after %.1f s; the app's own packages are "
                "imported afresh by each ClientApp process (%s)",
                event["pid"],
                event["import_s"],
                ", ".join(event["forgotten"]) or "none were imported",
            )
            if event["problem"]:
                log(WARNING, "[alignfl] the warm ClientApp parent cannot fork: %s", event["problem"])
            return
        task = event["task_id"]
        if kind == "started":
            self.pending.pop(task, None)
            self.children[task] = event["pid"]
            log(DEBUG, "[alignfl] task %d: ClientApp process pid %d forked", task, event["pid"])
        elif kind == "refused":
            self.pending.pop(task, None)
            self.outcomes[task] = f"refused: {event['reason']}"
            log(
                WARNING,
                "[alignfl] task %d: the warm parent refused to fork (%s); the SuperNode answers the "
                "message as for a lost ClientApp process",
                task,
                event["reason"],
            )
        elif kind == "killed":
            log(
                WARNING,
                "[alignfl] task %d: ClientApp process pid %d ran past --message-timeout (%.0f s) and "
                "was killed; the SuperNode answers its message as for a lost ClientApp process",
                task,
                event["pid"],
                event["after_s"],
            )
        elif kind == "ended":
            self.children.pop(task, None)
            self.outcomes[task] = event["how"]
            self.cpu_s[task] = event["cpu_s"]
            level = INFO if event["how"] == "code 0" else WARNING
            log(
                level,
                "[alignfl] task %d: ClientApp process pid %d ended with %s after %.2f s, %.2f CPU-s",
                task,
                event["pid"],
                event["how"],
                event["seconds"],
                event["cpu_s"],
            )

    def wait_idle(self, timeout_s: float) -> bool:
        """Poll until no task is pending or running (tests, benchmarks); whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.reconcile()
            if not self.pending and not self.children:
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        """Stop the parent and, with it, its children."""
        if self.parent is not None:
            for event in self.parent.read_events():
                self.record(event)
            self.parent.stop()
            self.parent = None
        self.fallback.close()
