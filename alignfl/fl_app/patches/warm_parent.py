"""The warm parent of a SuperNode's ClientApp processes: imports once, forks a fresh child per message.

Flower's own executor starts ``flwr-clientapp`` afresh for every message, and each such process pays seconds of
CPU for Python, Flower, torch and the app's other dependencies before its first useful line. This process pays
them once: it imports Flower's ClientApp runner and the app's module (``--app``), then, for every task its
executor (:mod:`alignfl.fl_app.patches.warm_executor`) sends it, forks a child that does what ``flwr-clientapp`` does
(connect to the SuperNode's Runtime API with the task's token, pull the message, install the FAB, load and run the
ClientApp, push the reply and the context) and exits. Flower's isolation stays: one new process per message,
state only through ``context.state``.

What keeps a child the same as a fresh ``flwr-clientapp`` process:

* **The FAB is the code.** The app's own packages (those of the project that ``--app`` belongs to) are imported
  only for their dependencies and then forgotten (removed from ``sys.modules``) before any fork, so each child
  imports them from the installed FAB as a fresh process does; only third-party modules stay warm. A run whose
  FAB holds other code than this host's checkout runs the FAB's.
* **Nothing shared at fork time.** This process opens no connection, starts no Python thread and never
  initialises CUDA (checked before every fork); the only descriptors it holds besides the standard streams are
  its two pipes to the executor, closed in the child.
* **Fresh random state.** Python's ``random`` is reseeded by Python itself in a forked child; NumPy's global
  generator and torch's default one are reseeded from the OS here, as each fresh process seeds them.
* **Signals as a fresh process has them**, and ``PR_SET_PDEATHSIG``: a child gets SIGTERM when this process
  dies, however it dies (Flower's handler then ends it as it ends a ``flwr-clientapp`` told to stop).

A child that raises is handled by Flower's runner itself (an error reply). One that dies without a reply (a
crash, ``os._exit``) is answered by the SuperNode as for any ClientApp process that stops sending heartbeats
("ClientApp stopped responding."). One that runs past ``--message-timeout`` is killed (SIGKILL), after which the
SuperNode answers the same way and takes the node's next message; Flower's own executor has no such limit, so
a hung ``flwr-clientapp`` holds its node for the rest of the run. This process keeps serving in every case.

Protocol (JSON lines): tasks arrive on ``--requests-fd`` as :class:`ExecutionSpec` fields; events leave on
``--events-fd``: ``ready``, then per task ``started`` (pid), ``killed`` (past the timeout) and ``ended`` (exit
code or signal, seconds, CPU-seconds). End of input, SIGTERM or SIGINT: the children get SIGTERM, SIGKILL after
a grace period, and this process exits.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import errno
import importlib
import importlib.util
import json
import os
import select
import signal
import site
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Any

from alignfl.fl_app.patches import seam
from alignfl.fl_app.patches.object_pulls import retry_object_pulls_sooner

DEFAULT_APP = "alignfl.fl_app.client_app"
RUNNER = "flwr.supernode.runtime.run_clientapp.run_clientapp"
"""Flower's ClientApp runner: what ``flwr-clientapp`` calls, imported by the parent before any fork."""
CERTIFICATES = "flwr.supercore.tls.validate_and_resolve_root_certificates"
NEEDS = (RUNNER, CERTIFICATES)
"""The Flower internals the parent's children run (:mod:`alignfl.fl_app.patches.warm_superexec` checks them)."""
STOP_GRACE_S = 10.0
POLL_S = 0.1
PR_SET_PDEATHSIG = 1

Target = Callable[[dict[str, Any]], None]
"""What a child runs for one task: receives the task's :class:`ExecutionSpec` fields (JSON types)."""


def run_clientapp_task(spec: dict[str, Any]) -> None:
    """What ``flwr-clientapp`` does for the task: Flower's own ClientApp runner, with the arguments Flower's
    subprocess executor would give the process (it ends with ``sys.exit``)."""
    seam.get(RUNNER)(
        runtime_api_address=spec["runtime_api_address"],
        token=spec["token"],
        insecure=spec["insecure"],
        certificates=seam.get(CERTIFICATES)(spec["root_certificates_path"], spec["insecure"]),
        parent_pid=spec["parent_pid"],
        runtime_dependency_install=spec["runtime_dependency_install"],
    )


def load_target(reference: str) -> Target:
    """``module:function`` → the function."""
    module, _, name = reference.partition(":")
    if not module or not name:
        raise ValueError(f"--target {reference!r} is not of the form module:function")
    return getattr(importlib.import_module(module), name)


def _site_folders() -> set[Path]:
    return {Path(folder).resolve() for folder in [*site.getsitepackages(), site.getusersitepackages()]}


def project_packages(module: str) -> set[str]:
    """The top-level packages of the project ``module`` belongs to: those of its installed distribution, and,
    where it is imported from a source checkout, every package beside its own (a FAB of the project ships them
    all, and a fresh ClientApp process imports each of them from the FAB)."""
    top = module.partition(".")[0]
    names = {top}
    owners = packages_distributions()
    mine = set(owners.get(top, ()))
    names |= {name for name, dists in owners.items() if mine & set(dists)}
    spec = importlib.util.find_spec(top)
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations))).resolve().parent
        if folder not in _site_folders():
            names |= {path.name for path in folder.iterdir() if (path / "__init__.py").is_file()}
    return names


def forget(packages: set[str]) -> list[str]:
    """Remove these packages' modules from ``sys.modules`` (the next import reads them again); their names."""
    gone = sorted(name for name in sys.modules if name.partition(".")[0] in packages)
    for name in gone:
        del sys.modules[name]
    return gone


def fork_problem() -> str | None:
    """Why forking now would share something a fresh process would not have, or None."""
    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads are running: {threading.enumerate()}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised"
    return None


def _set_parent_death_signal(signum: int) -> None:
    """``prctl(PR_SET_PDEATHSIG)``: the kernel sends ``signum`` to this process when its parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _fresh_random_state() -> None:
    """NumPy's and torch's global generators seeded from the OS, as each fresh process seeds them when it
    imports them (Python's ``random`` is reseeded by Python itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def _exit_code(exit: SystemExit) -> int:
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)
    return 1


def _child(spec: dict[str, Any], target: Target, parent: int, pipes: tuple[int, int]) -> int:
    """Runs in the forked child: become a fresh ClientApp process, run ``target``; the exit code."""
    for fd in pipes:
        os.close(fd)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the line above
        return 1
    _fresh_random_state()
    sys.argv = ["flwr-clientapp"]
    if spec.get("suppress_output"):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    try:
        target(spec)
        return 0
    except SystemExit as exit:
        return _exit_code(exit)
    except BaseException:  # pylint: disable=broad-exception-caught
        traceback.print_exc()
        return 1


@dataclass
class Child:
    task_id: int
    started: float
    killed: bool = False


class WarmParent:
    """The fork loop: reads tasks, forks children, reaps them, kills those past the timeout."""

    def __init__(self, target: Target, requests: int, events: int, message_timeout: float | None) -> None:
        self.target = target
        self.requests = requests
        self.events = events
        self.message_timeout = message_timeout
        self.children: dict[int, Child] = {}
        self.buffer = b""
        self.stopping = False

    def emit(self, event: str, **fields: Any) -> None:
        """One event line to the executor; a vanished executor ends the loop."""
        try:
            os.write(self.events, (json.dumps({"event": event, **fields}) + "\n").encode())
        except BrokenPipeError:
            self.stopping = True

    def stop(self, _signum: int, _frame: object) -> None:
        self.stopping = True

    def serve(self) -> None:
        """Until the executor closes the pipe or a stop signal: fork per task, reap, enforce the timeout."""
        while not self.stopping:
            ready, _, _ = select.select([self.requests], [], [], POLL_S)
            if ready:
                self.read_tasks()
            self.reap()
            self.enforce_timeout()
        self.stop_children()

    def read_tasks(self) -> None:
        chunk = os.read(self.requests, 1 << 16)
        if not chunk:
            self.stopping = True
            return
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            if line.strip():
                self.fork(json.loads(line))

    def fork(self, spec: dict[str, Any]) -> None:
        problem = fork_problem()
        if problem is not None:  # a child would share it: refuse, the task's token expires as for a lost process
            self.emit("refused", task_id=spec["task_id"], reason=problem)
            return
        parent = os.getpid()
        sys.stdout.flush()  # a child would write out again what the parent's buffers hold
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(spec, self.target, parent, (self.requests, self.events))
            finally:
                try:
                    atexit._run_exitfuncs()  # what a process's normal exit runs
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        self.children[pid] = Child(spec["task_id"], time.monotonic())
        self.emit("started", task_id=spec["task_id"], pid=pid)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
            self.emit(
                "ended",
                task_id=child.task_id,
                pid=pid,
                how=how,
                killed=child.killed,
                seconds=round(time.monotonic() - child.started, 3),
                cpu_s=round(usage.ru_utime + usage.ru_stime, 3),
            )

    def enforce_timeout(self) -> None:
        if self.message_timeout is None:
            return
        now = time.monotonic()
        for pid, child in self.children.items():
            if not child.killed and now - child.started > self.message_timeout:
                _kill(pid, signal.SIGKILL)
                child.killed = True
                self.emit("killed", task_id=child.task_id, pid=pid, after_s=round(now - child.started, 3))

    def stop_children(self) -> None:
        """SIGTERM to every child, SIGKILL to those left after the grace period; all reaped."""
        for pid in self.children:
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.children and time.monotonic() < deadline:
            self.reap()
            time.sleep(POLL_S)
        for pid in self.children:
            _kill(pid, signal.SIGKILL)
        while self.children:
            self.reap()
            time.sleep(POLL_S)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError as error:
        if error.errno != errno.ESRCH:
            raise


def positive_seconds(text: str) -> float | None:
    """``--message-timeout``: seconds > 0, or ``none`` for no limit."""
    if text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: seconds > 0, or 'none' for no limit")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m alignfl.fl_app.patches.warm_parent", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--requests-fd", type=int, required=True, help="the pipe tasks arrive on")
    parser.add_argument("--events-fd", type=int, required=True, help="the pipe events leave on")
    parser.add_argument(
        "--app",
        default=DEFAULT_APP,
        help="module imported for its dependencies; its project's packages are then forgotten",
    )
    parser.add_argument(
        "--target",
        help="module:function a child runs for a task (default: Flower's ClientApp runner, as flwr-clientapp)",
    )
    parser.add_argument(
        "--message-timeout",
        type=positive_seconds,
        default=None,
        help="seconds after which a child is killed (default: no limit)",
    )
    args = parser.parse_args(argv)
    _set_parent_death_signal(signal.SIGTERM)  # the executor's process died: stop too
    started = time.monotonic()
    seam.get(RUNNER)  # imports Flower's runner and what it imports
    target = load_target(args.target) if args.target else run_clientapp_task
    try:
        importlib.import_module(args.app)
    except Exception as error:  # pylint: disable=broad-exception-caught
        print(
            f"[alignfl] warm parent: could not import {args.app} ({error!r}); its children import it themselves",
            file=sys.stderr,
            flush=True,
        )
    forgotten = forget(project_packages(args.app))
    retry_object_pulls_sooner()  # the children inherit it (the seam warns where it cannot)
    parent = WarmParent(target, args.requests_fd, args.events_fd, args.message_timeout)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, parent.stop)
    parent.emit(
        "ready",
        pid=os.getpid(),
        import_s=round(time.monotonic() - started, 3),
        forgotten=sorted({name.partition(".")[0] for name in forgotten}),
        problem=fork_problem(),
    )
    parent.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
