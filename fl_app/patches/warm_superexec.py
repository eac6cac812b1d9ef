"""``flower-superexec`` with warm ClientApp processes: ``python -m fl_app.patches.warm_superexec [WARM OPTIONS] FLOWER ARGS``.

Flower 1.41's SuperExec takes its executor from ``get_executor`` and offers no option to name another one; this
entry point runs Flower's own ``flower-superexec`` (same arguments, same loop, same logs) with
``get_executor`` answering :class:`fl_app.patches.warm_executor.WarmExecutor` for the subprocess executor, the only one
that starts local processes. Its own options come first and are taken off before Flower parses the rest:

    python -m fl_app.patches.warm_superexec --message-timeout 3600 --runtime-api-address 127.0.0.1:9094 --insecure

It is installed only on the Flower releases whose SuperExec, executors and ClientApp runner were read
(:data:`CHECKED_FLOWER`) and where processes can fork; anywhere else, or with ``--executor`` other than
``subprocess``, it warns and runs Flower's SuperExec unchanged.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from collections.abc import Callable
from importlib.metadata import version
from logging import WARNING
from typing import Any

from flwr.supercore import log
from flwr.supercore.cli import flower_superexec
from flwr.supercore.constant import ExecutorType
from flwr.supercore.superexec.executor import Executor

from fl_app.patches.warm_executor import WarmExecutor
from fl_app.patches.warm_parent import DEFAULT_APP, positive_seconds

CHECKED_FLOWER = frozenset({"1.41.0", "1.42.0"})
"""Flower releases whose SuperExec loop (``run_superexec``), executor protocol and ClientApp runner
(``run_clientapp``) this was checked against."""
DEFAULT_MESSAGE_TIMEOUT_S = 3600.0
"""A ClientApp process that runs longer is killed so its node can take the next message: the run config's
``round-timeout`` default, after which the server has dropped the reply anyway."""
LOOP_MODULE = "flwr.supercore.superexec.run_superexec"


def warm_get_executor(
    flower_get_executor: Callable[..., Executor],
    options: list[str],
    executor_type: ExecutorType,
    executor_config: Any = None,
    *,
    insecure: bool = False,
    root_certificates_path: str | None = None,
) -> Executor:
    """Flower's ``get_executor``, but the subprocess executor is the warm one."""
    if executor_type == ExecutorType.SUBPROCESS and executor_config is None:
        return WarmExecutor(options)
    return flower_get_executor(
        executor_type, executor_config, insecure=insecure, root_certificates_path=root_certificates_path
    )


def unusable(flower_args: list[str]) -> str | None:
    """Why the warm executor cannot run here, or None."""
    flower = version("flwr")
    if flower not in CHECKED_FLOWER:
        return f"Flower {flower} is not a release it was checked against ({', '.join(sorted(CHECKED_FLOWER))})"
    if not hasattr(os, "fork"):
        return "this platform cannot fork processes"
    executor = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    executor.add_argument("--executor", default=ExecutorType.SUBPROCESS.value)
    chosen = executor.parse_known_args(flower_args)[0].executor
    if chosen != ExecutorType.SUBPROCESS.value:
        return f"--executor {chosen} was asked for (the warm executor replaces only Flower's subprocess executor)"
    return None


def parse(argv: list[str]) -> tuple[list[str], list[str]]:
    """This entry point's options (as :mod:`fl_app.patches.warm_parent` options) and Flower's arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m fl_app.patches.warm_superexec",
        add_help=False,
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--message-timeout",
        type=positive_seconds,
        default=DEFAULT_MESSAGE_TIMEOUT_S,
        help="seconds after which a ClientApp process is killed so its node can take the next "
        f"message, or 'none' (default {DEFAULT_MESSAGE_TIMEOUT_S:.0f})",
    )
    parser.add_argument(
        "--app",
        default=DEFAULT_APP,
        help=f"the ClientApp module whose dependencies the warm parent imports (default {DEFAULT_APP})",
    )
    ours, flower_args = parser.parse_known_args(argv)
    timeout = "none" if ours.message_timeout is None else repr(ours.message_timeout)
    return ["--app", ours.app, "--message-timeout", timeout], flower_args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    options, flower_args = parse(argv)
    sys.argv = ["flower-superexec", *flower_args]
    problem = unusable(flower_args)
    if problem is not None:
        log(
            WARNING,
            "[alignfl] warm ClientApp processes are off: %s; Flower's own executor starts a fresh "
            "flwr-clientapp process per message",
            problem,
        )
    else:
        loop = importlib.import_module(LOOP_MODULE)
        loop.get_executor = functools.partial(warm_get_executor, loop.get_executor, options)
    flower_superexec()


if __name__ == "__main__":
    main()
