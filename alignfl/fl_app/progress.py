"""Progress you can see: the elapsed time and an estimate of the time left, for a run's rounds and a sweep's jobs.

A run's estimate is the mean time of the rounds this process has trained times the rounds left (a resumed run
counts from where it resumed, so the first session's start-up does not skew it). A sweep's is the mean time per
finished job since the sweep started, times the jobs left (:mod:`alignfl.fl_app.sweeps.launches` counts a sweep's own
jobs from their ``job.json`` records, so every job process of a parallel launcher sees the same numbers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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


def sweep_progress(done: int, failed: int, jobs: int | None = None, started: float | None = None) -> str:
    """``sweep: 5 of 12 jobs done (1 failed), 7 left, elapsed 10m03s, about 14m05s left`` for a sweep of ``jobs``
    jobs started at ``started`` (``time.time()``); the counts alone where its size is not known."""
    if jobs is None or started is None:
        return f"sweep: {done} jobs done ({failed} failed)"
    elapsed = time.time() - started
    left = max(0, jobs - done)
    text = f"sweep: {done} of {jobs} jobs done ({failed} failed), {left} left, elapsed {duration(elapsed)}"
    return f"{text}, about {duration(elapsed / done * left)} left" if done and left else text
