"""What tracking costs a round: the ServerApp's tracking calls timed inside a run of the default experiment.

Runs the default run config (FedAvg, MLP, Fashion-MNIST, Dirichlet 0.5, 10 clients) in-process for a few rounds
with ``tracking`` as asked, and times every call the ServerApp makes to :class:`alignfl.fl_app.tracking.Tracking`
(opening, each round's ``log_rows``, the end's ``finish`` and ``close``) against the rounds' wall time from
``metrics.jsonl``. The target: each round's tracking at most 1 % of the round.

    .venv/bin/python benchmarks/tracking_cost.py --rounds 4 --tracking tensorboard
    .venv/bin/python benchmarks/tracking_cost.py --rounds 4 --tracking both
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from alignfl.fl_app import tracking
from alignfl.fl_app.inprocess import run_in_process


def timed(calls: dict[str, list[float]], name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            calls[name].append(time.perf_counter() - started)

    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist (the default run) or digits")
    parser.add_argument("--tracking", default="tensorboard", choices=("tensorboard", "mlflow", "both"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    calls: dict[str, list[float]] = defaultdict(list)
    for name in ("log_rows", "finish", "close"):
        setattr(tracking.Tracking, name, timed(calls, name, getattr(tracking.Tracking, name)))
    tracking.Tracking.open = classmethod(timed(calls, "open", tracking.Tracking.open.__func__))  # type: ignore
    with tempfile.TemporaryDirectory(prefix="alignfl-tracking-cost-") as tmp:
        summary = run_in_process(
            {
                "dataset": args.dataset,
                "num-server-rounds": args.rounds,
                "results-dir": tmp,
                "run-name": "run",
                "tracking": args.tracking,
                "device": "cpu",
            },
            args.clients,
        )
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    rounds = [later["elapsed-s"] - earlier["elapsed-s"] for earlier, later in zip(rows, rows[1:])]
    per_round = calls["log_rows"][1:]  # the first call is the (empty) catch-up before round 1
    share = statistics.median(per_round) / statistics.median(rounds)
    print(
        f"tracking={args.tracking}, {args.dataset}, {args.clients} clients, {args.rounds} rounds, "
        f"load average {os.getloadavg()[0]:.1f}; status {summary['tracking']}"
    )
    print(f"round wall time: median {statistics.median(rounds):.2f} s ({', '.join(f'{s:.2f}' for s in rounds)})")
    print(
        f"tracking per round (log_rows): median {1000 * statistics.median(per_round):.1f} ms "
        f"({', '.join(f'{1000 * s:.1f}' for s in per_round)}) = {100 * share:.2f} % of a round (target <= 1 %)"
    )
    print(
        f"once per run: open {calls['open'][0]:.2f} s, finish {calls['finish'][0]:.2f} s, "
        f"close {1000 * calls['close'][0]:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
