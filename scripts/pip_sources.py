"""Print pip's configured package sources (index URLs, find-links, constraints) as uv's options, one a line.

scripts/setup.sh installs with ``uv pip install``, which does not read pip's configuration files; a machine whose
pip takes wheels from a local index or folder (or caps versions by a constraints file) gets the same from uv.
"""

import shlex
import subprocess
import sys

OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
"""pip's configuration keys and the uv options that take the same values."""


def uv_options(listing: str) -> list[str]:
    """``pip config list``'s lines (``global.extra-index-url='a b'``) as uv options, each value once."""
    options: list[str] = []
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        option = OPTIONS.get(key.split(".", 1)[-1])
        for item in " ".join(shlex.split(value)).split() if option else []:
            if item not in options[1::2]:
                options += [option, item]
    return options


if __name__ == "__main__":
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    print(*uv_options(listing), sep="\n")
