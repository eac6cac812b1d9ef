"""Which sweep runs which job of a sweep folder: a record per launch of a sweep, and a live marker on each running job.

Several sweeps may share one folder (the drift study's second command adds seeds to the first one's folder, both
running side by side), and a sweep run again in its folder goes on where it stopped. So each launch records its
own jobs when its check passes (:func:`start_launch`, under :data:`LAUNCHES`); a job writes its launch into its
``job.json``, and a launch's progress lines count its own jobs alone (:func:`launch_progress`). While a job runs,
its process holds an exclusive ``flock`` on the job's marker (:data:`JOB_MARKER`: its pid, host and start time),
so a report written meanwhile by another sweep lists the job as running (:func:`running`), never as failed. The
kernel drops the lock when the process ends however it ends (SIGKILL included), so a marker a killed job left
behind reads as a job that did not finish.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alignfl.fl_app.progress import sweep_progress

log = logging.getLogger(__name__)

LAUNCHES = "launches"
"""Folder of the sweep folder with one record per launch: its jobs' overrides, start time, process and host."""
JOB_MARKER = "job.lock"
"""In a job's folder while a process runs the job: that process's pid, host and start time, flock-ed."""
LAUNCH_KEY = "launch"
"""The key of ``job.json`` that names the launch that ran the job last."""


class JobBusy(RuntimeError):
    """Another live process runs the job in this folder."""


def _host() -> str:
    return socket.gethostname()


def start_launch(sweep_dir: Path, jobs: Sequence[Sequence[str]]) -> str:
    """Record a launch's jobs (each one's overrides, as Hydra writes them to its ``.hydra/overrides.yaml``) and
    start time; returns the launch's id."""
    started = time.time()
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started))
    launch = f"{stamp}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder = sweep_dir / LAUNCHES
    folder.mkdir(parents=True, exist_ok=True)
    record = {"jobs": [list(job) for job in jobs], "started": started, "pid": os.getpid(), "host": _host()}
    (folder / f"{launch}.json").write_text(json.dumps(record) + "\n")
    return launch


def _launches(sweep_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every launch recorded in the folder, the latest started last."""
    found = []
    for path in (sweep_dir / LAUNCHES).glob("*.json"):
        try:
            found.append((path.stem, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue  # one being written, or not ours
    return sorted(found, key=lambda item: float(item[1].get("started", 0)))


def launch_of_job(sweep_dir: Path, overrides: Sequence[str]) -> str | None:
    """The latest launch whose jobs include these overrides (a job's own process asks), or None."""
    wanted = list(overrides)
    for launch, record in reversed(_launches(sweep_dir)):
        if wanted in record.get("jobs", []):
            return launch
    return None


def own_launch(sweep_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """The latest launch this process started in the folder (its pid and host), or None."""
    for launch, record in reversed(_launches(sweep_dir)):
        if record.get("pid") == os.getpid() and record.get("host") == _host():
            return launch, record
    return None


def launch_progress(sweep_dir: Path, launch: str | None, job_record: str, completed: str) -> str:
    """The progress line of ``launch``: its jobs whose record names it, against its size and start time; without
    a launch (a sweeper whose jobs are not checked in advance), every job record of the folder."""
    statuses = []
    for path in sweep_dir.glob(f"**/{job_record}"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written by another job's process
        if launch is None or record.get(LAUNCH_KEY) == launch:
            statuses.append(record.get("status"))
    failed = sum(status != completed for status in statuses)
    meta = dict(_launches(sweep_dir)).get(launch) if launch is not None else None
    if meta is None:
        return sweep_progress(len(statuses), failed)
    return sweep_progress(len(statuses), failed, len(meta["jobs"]), float(meta["started"]))


@contextmanager
def job_marker(job_dir: Path) -> Iterator[None]:
    """Hold the job's marker while the job runs; :class:`JobBusy` when a live process already holds it. On a file
    system without ``flock`` the job runs unmarked (a warning): a report may then list it as not finished."""
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / JOB_MARKER
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock(descriptor, job_dir)
        os.ftruncate(descriptor, 0)
        os.write(descriptor, json.dumps({"pid": os.getpid(), "host": _host(), "started": time.time()}).encode())
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # while still held: a reader then sees the job's record, not a marker
    finally:
        os.close(descriptor)  # drops the lock


def _lock(descriptor: int, job_dir: Path, tries: int = 20, pause_s: float = 0.05) -> None:
    """Lock the marker for the job; a report's reader holds it shared for an instant, so a few tries."""
    for attempt in range(tries):
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                log.warning("job folder %s: no flock here (%s); the job runs without its marker", job_dir, error)
                return
            if attempt + 1 < tries:
                time.sleep(pause_s)
    raise JobBusy(f"job folder {job_dir} is being run by another live process ({_holder(descriptor)})")


def _holder(descriptor: int) -> str:
    """``pid 123 on host h since 12:00:01`` from a marker's text."""
    try:
        os.lseek(descriptor, 0, os.SEEK_SET)
        marker = json.loads(os.read(descriptor, 4096) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(marker["started"])))
        return f"pid {marker['pid']} on {marker['host']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its marker unreadable"


def running(job_dir: Path) -> str | None:
    """Who runs the job now (``pid 123 on host h since …``) when a live process holds its marker, else None (no
    marker, or one left by a process that has ended)."""
    try:
        descriptor = os.open(job_dir / JOB_MARKER, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:
        return _holder(descriptor) if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    else:
        return None  # nobody holds it: the process that wrote it has ended
    finally:
        os.close(descriptor)
