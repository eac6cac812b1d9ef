"""``flower-supernode`` that asks for messages every few tenths of a second:
``python -m alignfl.fl_app.patches.polling_supernode [--poll-interval S] FLOWER ARGS``.

Flower's SuperNode (1.41, 1.42) sleeps a fixed 3 s whenever its SuperLink has no message for it
(``flwr.supernode.start_client_internal``), and it has none right after the node replies: the server sends the
next wave only once every reply is in. A round of training then evaluation waits ~3 s twice for the nodes' next
poll, whatever the work. This entry point runs Flower's own ``flower-supernode`` (same arguments, loop and logs)
with the pull step asking again every ``--poll-interval`` seconds until a message comes, so a wave waits half an
interval on average (``--poll-interval flower``: Flower's loop untouched), and with object pulls that retry
sooner (:mod:`alignfl.fl_app.patches.object_pulls`). The price is requests: each idle node asks its SuperLink ``1 /
interval`` times a second (Flower's: 1/3); with many nodes on one SuperLink, a longer interval keeps it cool.

It is installed through :mod:`alignfl.fl_app.patches.seam`: where the installed Flower is not one whose SuperNode loop
was read, or its pull step is not there as read, it warns and runs Flower's SuperNode unchanged.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from logging import INFO
from typing import Any

from flwr.common.logger import log

from alignfl.fl_app.patches import seam
from alignfl.fl_app.patches.object_pulls import retry_object_pulls_sooner

PULL_STEP = "flwr.supernode.start_client_internal._pull_and_store_message"
"""Flower's SuperNode loop (``start_client_internal``): pull, and sleep 3 s when nothing came; then push."""
FLOWER_NODE_POLL_S = 3.0
"""Seconds Flower's SuperNode waits before asking its SuperLink again when it had no message."""
DEFAULT_NODE_POLL_S = 0.5
"""Seconds between an idle SuperNode's requests for a message with this entry point: a wave of messages waits
~0.25 s for its nodes instead of ~1.5-3 s, for 2 requests a second per idle node."""


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


def parse(argv: list[str]) -> tuple[float | None, list[str]]:
    """This entry point's poll interval (None: Flower's own) and Flower's arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m alignfl.fl_app.patches.polling_supernode",
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


PATCH = seam.Patch(lost=f"the SuperNode polls every {FLOWER_NODE_POLL_S:g} s as Flower's own does", needs=(PULL_STEP,))


def poll_every(interval: float) -> None:
    """Install the pull step that asks again every ``interval`` seconds (through :data:`PATCH`)."""
    seam.replace(PULL_STEP, functools.partial(pull_until_message, seam.get(PULL_STEP), interval))


def flower_supernode() -> None:
    """Flower's ``flower-supernode`` command, which reads ``sys.argv``."""
    seam.flower_command("flower-supernode")()


def main(argv: list[str] | None = None) -> None:
    interval, flower_args = parse(sys.argv[1:] if argv is None else argv)
    sys.argv = ["flower-supernode", *flower_args]
    retry_object_pulls_sooner()
    if interval is not None and seam.install(PATCH, lambda: poll_every(interval)):
        log(INFO, "[alignfl] the SuperNode asks for a message every %g s while it has none", interval)
    flower_supernode()


if __name__ == "__main__":
    main()
