"""``python -m alignfl.fl_app.config``: print, check or write the generated run-config tables
(:mod:`alignfl.fl_app.config.tables`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from alignfl.fl_app.config.tables import ROOT, pyproject_table, stale_files, write_all
from alignfl.fl_app.locations import program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("alignfl.fl_app.config"),
        description="Print pyproject.toml's generated [tool.flwr.app.config], or write (or check) every generated "
        "part: that table, the README's method table, docs/configuration.md's key tables and registered names.",
    )
    parser.add_argument("--write", action="store_true", help="rewrite the generated parts in place")
    parser.add_argument("--check", action="store_true", help="exit 1, naming the files, when a generated part is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help=f"the project's root (default: {ROOT})")
    args = parser.parse_args(argv)
    if args.write:
        for path, changed in write_all(args.root).items():
            print(f"{path.relative_to(args.root)} " + ("updated" if changed else "already current"))
    elif args.check:
        stale = stale_files(args.root)
        for path in stale:
            print(
                f"{path.relative_to(args.root)} is stale: run `python -m alignfl.fl_app.config --write`",
                file=sys.stderr,
            )
        return 1 if stale else 0
    else:
        print(pyproject_table(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
