"""Progress you can see: the elapsed time and an estimate of the time left, for a run's rounds and a sweep's jobs.

A run's estimate is the mean time of the rounds this process has trained times the rounds left (a resumed run
counts from where it resumed, so the first session's start-up does not skew it). A sweep's is the mean time per
finished job since the sweep started, times the jobs left; the jobs are counted from their ``job.json`` records,
so every job process of a parallel launcher sees the same numbers.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

SWEEP_RECORD = "sweep.json"
"""Written by the sweep's validation at its start: how many jobs it has and when it started."""


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@dataclass
class RoundProgress:
    """Rounds ``first_round`` … ``total_rounds`` trained by this process."""

    total_rounds: int
    first_round: int = 1
    started: float = field(default_factory=time.monotonic)

    def describe(self, server_round: int, elapsed_s: float) -> str:
        """``round 3/10, elapsed 12s, about 28s left`` (round 0, the initial model, has no estimate yet)."""
        done = server_round - self.first_round + 1
        text = f"round {server_round}/{self.total_rounds}, elapsed {duration(elapsed_s)}"
        if done <= 0:
            return text
        left = (time.monotonic() - self.started) / done * (self.total_rounds - server_round)
        return f"{text}, about {duration(left)} left"


def start_sweep(sweep_dir: Path, jobs: int) -> None:
    """Record the sweep's size and start time for the progress lines of its jobs."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / SWEEP_RECORD).write_text(json.dumps({"jobs": jobs, "started": time.time()}) + "\n")


def sweep_progress(sweep_dir: Path, job_record: str, completed: str) -> str:
    """``sweep: 5 of 12 jobs done (1 failed), 7 left, elapsed 10m03s, about 14m05s left``, from the jobs' records."""
    statuses = [json.loads(path.read_text()).get("status") for path in sweep_dir.glob(f"**/{job_record}")]
    done, failed = len(statuses), sum(status != completed for status in statuses)
    record = sweep_dir / SWEEP_RECORD
    if not record.is_file():
        return f"sweep: {done} jobs done ({failed} failed)"
    meta = json.loads(record.read_text())
    elapsed = time.time() - float(meta["started"])
    left = max(0, int(meta["jobs"]) - done)
    text = f"sweep: {done} of {meta['jobs']} jobs done ({failed} failed), {left} left, elapsed {duration(elapsed)}"
    return f"{text}, about {duration(elapsed / done * left)} left" if done and left else text
