"""``python -m alignfl.fl_app.analysis <tool> [options]``: run one PAN diagnostic, write JSON + PNG.

The tools live in a name -> :class:`~alignfl.fl_app.analysis.common.Subcommand` registry; each
checks its arguments before doing any work and exits with status 2 and a one-line
message on bad input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from alignfl.fl_app.analysis import depth, divergence, matching, merge, preference, shuffle
from alignfl.fl_app.analysis.common import AnalysisError, Subcommand, check_out_dir
from alignfl.fl_app.locations import program

SUBCOMMANDS: dict[str, Subcommand] = {
    command.name: command
    for command in (
        shuffle.COMMAND,
        divergence.COMMAND,
        matching.COMMAND,
        preference.COMMAND,
        depth.COMMAND,
        merge.COMMAND,
    )
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program("alignfl.fl_app.analysis"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tools = parser.add_subparsers(dest="tool", required=True, metavar="<tool>")
    for command in SUBCOMMANDS.values():
        sub = tools.add_parser(
            command.name,
            help=command.summary,
            description=command.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = SUBCOMMANDS[args.tool]
    try:
        out = check_out_dir(args.out, command.name)
        written = command.run(args, out)
    except (AnalysisError, FileNotFoundError) as error:
        print(f"{parser.prog} {command.name}: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
