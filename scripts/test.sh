#!/usr/bin/env bash
# Set up (first time only), check formatting and lint (ruff), and run every test, the end-to-end
# simulations included.
# Pass pytest arguments through, e.g. ./scripts/test.sh -m "not slow" for the fast ones. Tests run in
# ALIGNFL_TEST_WORKERS processes (default 2, pytest-xdist), one test file per process at a time (a file's
# deployment or simulation fixtures are set up once), the longest files first (tests/conftest.py orders them);
# ALIGNFL_TEST_WORKERS=0 runs them in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export FLWR_TELEMETRY_ENABLED=0
# One OpenMP thread, as Ray gives its workers: the tests compare in-process rows with Ray-run rows bit for bit.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check --quiet . && .venv/bin/ruff format --check --quiet . \
  || { echo "[test] ruff found problems: run .venv/bin/ruff check --fix . && .venv/bin/ruff format ." >&2; exit 1; }
exec .venv/bin/python -m pytest -n "${ALIGNFL_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
