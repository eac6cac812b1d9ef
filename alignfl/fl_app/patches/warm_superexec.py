"""``flower-superexec`` with warm ClientApp processes:
``python -m alignfl.fl_app.patches.warm_superexec [WARM OPTIONS] FLOWER ARGS``.

Flower's SuperExec (1.41, 1.42) takes its executor from ``get_executor`` and offers no option to name another one; this
entry point runs Flower's own ``flower-superexec`` (same arguments, same loop, same logs) with
``get_executor`` answering :class:`alignfl.fl_app.patches.warm_executor.WarmExecutor` for the subprocess executor, the
only one that starts local processes. Its own options come first and are taken off before Flower parses the rest:

    python -m alignfl.fl_app.patches.warm_superexec --message-timeout 3600 --runtime-api-address 127.0.0.1:9094 --insecure

It is installed through :mod:`alignfl.fl_app.patches.seam` where processes can fork: where the installed Flower is not
one whose SuperExec, executors and ClientApp runner were read, or one of those names is not there as read, or
with ``--executor`` other than ``subprocess``, it warns and runs Flower's SuperExec unchanged.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from logging import WARNING
from typing import Any

from flwr.common.logger import log

from alignfl.fl_app.patches import seam, warm_executor, warm_parent
from alignfl.fl_app.patches.warm_executor import Executor, WarmExecutor
from alignfl.fl_app.patches.warm_parent import DEFAULT_APP, positive_seconds

DEFAULT_MESSAGE_TIMEOUT_S = 3600.0
"""A ClientApp process that runs longer is killed so its node can take the next message: the run config's
``round-timeout`` default, after which the server has dropped the reply anyway."""
GET_EXECUTOR = "flwr.supercore.superexec.run_superexec.get_executor"
"""What Flower's SuperExec loop asks for its executor."""
EXECUTOR_TYPE = "flwr.supercore.constant.ExecutorType"
PATCH = seam.Patch(
    lost="warm ClientApp processes are off; Flower's own executor starts a fresh flwr-clientapp process per message",
    needs=(GET_EXECUTOR, EXECUTOR_TYPE, *warm_executor.NEEDS, *warm_parent.NEEDS),
)


def warm_get_executor(
    flower_get_executor: Callable[..., Executor],
    options: list[str],
    executor_type: Any,
    executor_config: Any = None,
    *,
    insecure: bool = False,
    root_certificates_path: str | None = None,
) -> Executor:
    """Flower's ``get_executor``, but the subprocess executor is the warm one."""
    if executor_type == seam.get(EXECUTOR_TYPE).SUBPROCESS and executor_config is None:
        return WarmExecutor(options)
    return flower_get_executor(
        executor_type, executor_config, insecure=insecure, root_certificates_path=root_certificates_path
    )


def unusable(flower_args: list[str]) -> str | None:
    """Why the warm executor cannot run here, Flower's internals aside (the seam checks those), or None."""
    if not hasattr(os, "fork"):
        return "this platform cannot fork processes"
    subprocess = seam.get(EXECUTOR_TYPE).SUBPROCESS.value
    executor = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    executor.add_argument("--executor", default=subprocess)
    chosen = executor.parse_known_args(flower_args)[0].executor
    if chosen != subprocess:
        return f"--executor {chosen} was asked for (the warm executor replaces only Flower's subprocess executor)"
    return None


def warm_up(options: list[str], flower_args: list[str]) -> None:
    """Flower's SuperExec loop gets the warm executor for the subprocess one (installed through :data:`PATCH`);
    where it cannot run here, a warning."""
    problem = unusable(flower_args)
    if problem is not None:
        log(WARNING, "[alignfl] %s: %s", PATCH.lost, problem)
        return
    seam.replace(GET_EXECUTOR, functools.partial(warm_get_executor, seam.get(GET_EXECUTOR), options))


def flower_superexec() -> None:
    """Flower's ``flower-superexec`` command, which reads ``sys.argv``."""
    seam.flower_command("flower-superexec")()


def parse(argv: list[str]) -> tuple[list[str], list[str]]:
    """This entry point's options (as :mod:`alignfl.fl_app.patches.warm_parent` options) and Flower's arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m alignfl.fl_app.patches.warm_superexec",
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
    seam.install(PATCH, lambda: warm_up(options, flower_args))
    flower_superexec()


if __name__ == "__main__":
    main()
