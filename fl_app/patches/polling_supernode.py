"""``flower-supernode`` that asks for messages every few tenths of a second: ``python -m fl_app.patches.polling_supernode
[--poll-interval S] FLOWER ARGS``.

Flower 1.41's SuperNode sleeps a fixed 3 s whenever its SuperLink has no message for it
(``flwr/supernode/start_client_internal.py``), and it has none right after the node replies: the server sends the
next wave only once every reply is in. A round of training then evaluation waits ~3 s twice for the nodes' next
poll, whatever the work. This entry point runs Flower's own ``flower-supernode`` (same arguments, loop and logs)
with the pull step asking again every ``--poll-interval`` seconds until a message comes, so a wave waits half an
interval on average (``--poll-interval flower``: Flower's loop untouched), and with object pulls that retry
sooner (:mod:`fl_app.patches.object_pulls`). The price is requests: each idle node asks its SuperLink ``1 / interval``
times a second (Flower's: 1/3); with many nodes on one SuperLink, a longer interval keeps it cool.

It is installed only on the Flower releases whose SuperNode loop was read (:data:`CHECKED_FLOWER`); anywhere else
it warns and runs Flower's SuperNode unchanged.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from logging import INFO, WARNING
from typing import Any

from flwr.supercore import log
from flwr.supernode.cli import flower_supernode

from fl_app.patches.object_pulls import retry_object_pulls_sooner

CHECKED_FLOWER = frozenset({"1.41.0", "1.42.0"})
"""Flower releases whose SuperNode loop (``start_client_internal``: pull, else sleep 3 s; push) this was checked
against."""
LOOP_MODULE = "flwr.supernode.start_client_internal"
PULL_STEP = "_pull_and_store_message"
FLOWER_NODE_POLL_S = 3.0
"""Seconds Flower 1.41's SuperNode waits before asking its SuperLink again when it had no message."""
DEFAULT_NODE_POLL_S = 0.5
"""Seconds between an idle SuperNode's requests for a message (fl_app/patches/polling_supernode.py): a wave of messages
waits ~0.25 s for its nodes instead of ~1.5-3 s, for 2 requests a second per idle node."""


def node_poll_interval(text: str) -> float | None:
    """``--node-poll``: seconds in (0, 3], or ``flower`` (None: Flower's own SuperNode, every 3 s)."""
    if text == "flower":
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= FLOWER_NODE_POLL_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: seconds in (0, {FLOWER_NODE_POLL_S:g}], or 'flower' for Flower's own SuperNode"
        )
    return seconds


def pull_until_message(flower_pull: Callable[..., int | None], interval: float, *args: Any, **kwargs: Any) -> int:
    """Flower's pull step, asked again every ``interval`` seconds until it has stored a message; its run id."""
    while (run_id := flower_pull(*args, **kwargs)) is None:
        time.sleep(interval)
    return run_id


def unusable() -> str | None:
    """Why the faster poll cannot be installed here, or None."""
    flower = version("flwr")
    if flower not in CHECKED_FLOWER:
        return f"Flower {flower} is not a release it was checked against ({', '.join(sorted(CHECKED_FLOWER))})"
    if not callable(getattr(importlib.import_module(LOOP_MODULE), PULL_STEP, None)):
        return f"{LOOP_MODULE} has no {PULL_STEP}"
    return None


def parse(argv: list[str]) -> tuple[float | None, list[str]]:
    """This entry point's poll interval (None: Flower's own) and Flower's arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m fl_app.patches.polling_supernode",
        add_help=False,
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--poll-interval",
        type=node_poll_interval,
        default=DEFAULT_NODE_POLL_S,
        help=f"seconds between an idle node's requests for a message, or 'flower' for Flower's "
        f"own {FLOWER_NODE_POLL_S:g} s (default {DEFAULT_NODE_POLL_S:g})",
    )
    ours, flower_args = parser.parse_known_args(argv)
    return ours.poll_interval, flower_args


def main(argv: list[str] | None = None) -> None:
    interval, flower_args = parse(sys.argv[1:] if argv is None else argv)
    sys.argv = ["flower-supernode", *flower_args]
    pulls_problem = retry_object_pulls_sooner()
    if pulls_problem is not None:
        log(WARNING, "[alignfl] the SuperNode retries object pulls after Flower's 1 s: %s", pulls_problem)
    problem = None if interval is None else unusable()
    if problem is not None:
        log(WARNING, "[alignfl] the SuperNode polls every %g s as Flower's own does: %s", FLOWER_NODE_POLL_S, problem)
    elif interval is not None:
        loop = importlib.import_module(LOOP_MODULE)
        setattr(loop, PULL_STEP, functools.partial(pull_until_message, getattr(loop, PULL_STEP), interval))
        log(INFO, "[alignfl] the SuperNode asks for a message every %g s while it has none", interval)
    flower_supernode()


if __name__ == "__main__":
    main()
