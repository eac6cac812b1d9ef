"""Process supervision: start a command in a session of its own, find every process it starts (also after their
parents died), and stop all of them by process id; stop signals turned into an exception that unwinds through
every ``finally`` that stops processes.

The launcher (:mod:`alignfl.fl_app.runtime.launch`), the loopback deployment (:mod:`alignfl.fl_app.runtime.deployment`)
and the compose check (``tests/compose_scenarios.py``) start and stop everything through here:

    with stop_signals():
        tree = start_process(["flower-superlink", ...], env, cwd, stdout=log)
        try:
            ...
        finally:
            stop_processes([tree])
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal arrived. Like KeyboardInterrupt it unwinds through every ``finally`` that stops
    processes, and no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _StopSignals:
    """Raises :class:`Stopped` for the first stop signal only; one that comes while processes are being
    stopped waits until they are, so a second Ctrl-C never leaves half of them running."""

    def __init__(self) -> None:
        self.raised = False
        self.pending: int | None = None
        self.holding = 0

    def handle(self, signum: int, _frame: object) -> None:
        if self.raised:
            return
        if self.holding:
            self.pending = signum
            return
        self.raised = True
        raise Stopped(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
        if not self.holding and self.pending is not None and not self.raised:
            self.raised = True
            raise Stopped(self.pending)


_SIGNALS = _StopSignals()


@contextmanager
def stop_signals() -> Iterator[None]:
    """Within the block, SIGTERM, SIGINT and SIGHUP raise :class:`Stopped` in the main thread; the handlers
    before are restored after it. Blocks may nest (a sweep job around the launcher's SuperLink): the inner one
    leaves the outer one's handlers as they were. Outside the main thread, where no handler can be set, it does
    nothing."""
    global _SIGNALS
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = _SIGNALS
    _SIGNALS = _StopSignals()
    previous = {signum: signal.signal(signum, _SIGNALS.handle) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        outer.raised = outer.raised or _SIGNALS.raised  # a Stopped that unwinds the outer block is raised once
        _SIGNALS = outer


@dataclass(frozen=True)
class ProcessStat:
    """What /proc/<pid>/stat says of a process that finding and stopping process trees needs."""

    ppid: int
    pgid: int
    sid: int
    start: int
    """Clock ticks after boot: with the pid, it names one process (pids are reused)."""
    zombie: bool


def _stat(pid: int) -> ProcessStat | None:
    """A process's entry in /proc, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            fields = stream.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    except OSError:
        return None
    return ProcessStat(int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]), fields[0] == "Z")


def process_table() -> dict[int, ProcessStat]:
    """Every process on this machine."""
    stats = {int(entry.name): _stat(int(entry.name)) for entry in os.scandir("/proc") if entry.name.isdigit()}
    return {pid: stat for pid, stat in stats.items() if stat is not None}


@dataclass
class ProcessTree:
    """A started process and every process started from it, found by process id even after their parent died
    (Flower's SuperExec runs in a session of its own, Ray's daemons outlive their parent there): each
    :meth:`refresh` remembers the members by pid and start time, and the sessions and groups they lead."""

    process: subprocess.Popen
    members: dict[int, int] = field(default_factory=dict)
    """pid → start time of every process seen in the tree."""
    leaders: set[int] = field(default_factory=set)
    """Sessions and process groups led by a member (never this process's own)."""

    def refresh(self, table: dict[int, ProcessStat] | None = None) -> dict[int, int]:
        """The tree's live processes now (pid → start time); remembers them."""
        table = table if table is not None else process_table()
        own = {os.getpid(), os.getsid(0), os.getpgrp()}
        found = {pid for pid, start in self.members.items() if pid in table and table[pid].start == start}
        self.leaders = {
            leader
            for leader in self.leaders
            if any(table[pid].sid == leader or table[pid].pgid == leader for pid in found)
        }
        if self.process.poll() is None and self.process.pid in table:
            found.add(self.process.pid)
        while True:
            self.leaders |= {pid for pid in found if pid not in own and pid in (table[pid].sid, table[pid].pgid)}
            grown = found | {
                pid
                for pid, stat in table.items()
                if pid not in own and (stat.ppid in found or stat.sid in self.leaders or stat.pgid in self.leaders)
            }
            if grown == found:
                break
            found = grown
        live = {pid: table[pid].start for pid in found if not table[pid].zombie}
        self.members.update(live)
        return live


@contextmanager
def stops_deferred() -> Iterator[None]:
    """A stop signal that comes within the block raises :class:`Stopped` only after it, so clean-up that it
    guards (stopping processes, removing their folders) is never cut short."""
    with _SIGNALS.held():
        yield


def stop_processes(trees: Sequence[ProcessTree], grace_s: float = 20.0) -> None:
    """Stop every process of these trees: SIGTERM to all at once, SIGKILL to what is left after ``grace_s``.
    A stop signal that comes meanwhile waits until this is done."""
    with stops_deferred():
        signalled: set[tuple[int, int]] = set()
        deadline = time.monotonic() + grace_s
        while True:
            for tree in trees:
                tree.process.poll()  # reaps it once it exits
            table = process_table()
            live = {(pid, start) for tree in trees for pid, start in tree.refresh(table).items()}
            if not live:
                break
            final = time.monotonic() > deadline
            for pid, start in live - (set() if final else signalled):
                _signal(pid, start, signal.SIGKILL if final else signal.SIGTERM)
            signalled |= live
            time.sleep(0.2)
        for tree in trees:
            tree.process.wait()


def _signal(pid: int, start: int, signum: int) -> None:
    """Signal one process, unless its pid now names another one."""
    stat = _stat(pid)
    if stat is not None and stat.start == start:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def start_process(command: list[str], env: dict[str, str], cwd: Path, **streams: Any) -> ProcessTree:
    """Start ``command`` in a session of its own (a Ctrl-C in the terminal reaches only this program, which
    stops it), as a :class:`ProcessTree`."""
    return ProcessTree(
        subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=True, **streams)
    )


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a service's log file (empty when it has none yet), for error messages."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:])


def exit_description(code: int) -> str:
    """``code 3``, or ``signal SIGKILL`` for a process a signal ended (Popen's negative return codes)."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
