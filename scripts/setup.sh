#!/usr/bin/env bash
# Set up a fresh machine: Fashion-MNIST from Debian, then a virtual environment with the project.
# Idempotent: a second call only checks. Needs Python 3.11 and the package registries (PyPI, Debian).
set -euo pipefail
cd "$(dirname "$0")/.."

FMNIST_DIR=/usr/share/datasets/fashion-mnist
if [ ! -f "$FMNIST_DIR/train-images-idx3-ubyte.gz" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing Fashion-MNIST (Debian package dataset-fashion-mnist)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "[setup] Fashion-MNIST is missing: run 'sudo apt-get install -y dataset-fashion-mnist'" \
         "or pass data-root=<torchvision root holding FashionMNIST/raw>" >&2
  fi
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "[setup] Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

STAMP=.venv/.alignfl-installed
WANT=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] creating .venv and installing the project (torch comes from this machine's disk when present)"
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  # uv (one of Flower's own dependencies) installs what pip would, from the indexes, links and constraints pip is
  # configured with, several packages at a time and with their bytecode compiled as pip does (where
  # PYTHONDONTWRITEBYTECODE is set, no process would cache it): ~45 s on a fresh 2-core machine where pip takes ~100 s.
  if ! { .venv/bin/python -m pip install -q uv \
      && mapfile -t PIP_SOURCES < <(.venv/bin/python scripts/pip_sources.py) \
      && .venv/bin/uv pip install -q --compile-bytecode --index-strategy unsafe-best-match \
        --python .venv/bin/python "${PIP_SOURCES[@]}" -e ".[dev]"; }; then
    echo "[setup] uv could not install the project; pip does" >&2
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[dev]"
  fi
  echo "$WANT" > "$STAMP"
fi
echo "[setup] ready: $(.venv/bin/python -c 'import flwr, torch; print("flwr", flwr.__version__, "torch", torch.__version__)')"
