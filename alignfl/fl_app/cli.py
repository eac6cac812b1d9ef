"""``alignfl <command> [options]``: the console script, one command for each ``python -m`` entry point.

    alignfl run --backend batched --num-supernodes 10 --run-config 'dataset="digits"'
    alignfl sweep -m seed=0,1,2
    alignfl merge --help

Each command hands the rest of its line to the ``main`` of its ``python -m`` form, so its options, help and exit
codes are that command's own, declared once. A command's module is imported only when the command runs, so
``alignfl --help`` answers before torch or Flower is loaded.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One sub-command: the module whose ``main()`` runs it, what it does, and the arguments that go before the
    user's (``merge`` is the analysis command's ``merge`` tool)."""

    module: str
    summary: str
    prefix: tuple[str, ...] = ()

    def python_m(self) -> str:
        """The same command as ``python -m ...``."""
        return " ".join(["python -m", self.module.removesuffix(".__main__"), *self.prefix])

    def called_as(self, name: str) -> str:
        """What the command's ``main`` finds as its program name (``sys.argv[0]``) under the console script:
        ``alignfl <name>``, or ``alignfl`` where the prefix is a sub-command of that ``main``'s parser that adds
        the name itself (``merge``)."""
        return "alignfl" if self.prefix else f"alignfl {name}"


COMMANDS = {
    "run": Command(
        "alignfl.fl_app.launch", "one experiment: Flower's simulation on a private SuperLink, or --backend batched"
    ),
    "sweep": Command(
        "alignfl.fl_app.sweep", "Hydra jobs, one or many (-m), and the papers' presets (+experiment=NAME)"
    ),
    "merge": Command(
        "alignfl.fl_app.analysis.__main__", "merge trained models in one shot and score the merges", ("merge",)
    ),
    "analysis": Command(
        "alignfl.fl_app.analysis.__main__", "the offline tools: shuffle, divergence, matching, preference, ..."
    ),
    "deploy": Command(
        "alignfl.fl_app.deploy", "a deployment as local processes, or one machine's part of one across hosts"
    ),
    "report": Command("alignfl.fl_app.sweeps.report", "a sweep's report again: summary.csv, summary.md, heatmap.png"),
    "config": Command("alignfl.fl_app.config.__main__", "print, check or regenerate the generated run-config tables"),
}
"""Every sub-command, in the order ``alignfl --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: a command's name, then everything after it, untouched, for that command."""
    listing = "\n".join(f"  {name:<9} {command.summary} ({command.python_m()})" for name, command in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="alignfl",
        description="alignfl's commands, each the same as its `python -m` form.",
        epilog=f"commands:\n{listing}\n\n`alignfl <command> --help` shows a command's own options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=COMMANDS, metavar="<command>", help="one of the commands below")
    parser.add_argument(
        "arguments", nargs=argparse.REMAINDER, metavar="...", help="the command's own options and overrides"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the named command with the rest of the line as its own arguments; its exit code."""
    args = build_parser().parse_args(argv)
    command = COMMANDS[args.command]
    sys.argv = [command.called_as(args.command), *command.prefix, *args.arguments]  # what each main() parses
    return importlib.import_module(command.module).main() or 0  # the sweep's main returns None when it succeeds


if __name__ == "__main__":
    sys.exit(main())
