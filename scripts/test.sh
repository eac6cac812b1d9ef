#!/usr/bin/env bash
# Set up (first time only) and run every test, the end-to-end simulations included.
# Pass pytest arguments through, e.g. ./scripts/test.sh -m "not slow" for the fast ones.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export FLWR_TELEMETRY_ENABLED=0
exec .venv/bin/python -m pytest "$@"
