#!/usr/bin/env bash
# Set up (first time only), then run one experiment on docker-compose.yml's topology as local processes:
# a SuperLink, N SuperNodes and their SuperExecs on 127.0.0.1, `flwr run` against them, everything stopped after.
# Exits non-zero if the run failed.
#   ./scripts/deploy.sh --num-supernodes 3 --rounds 5 --run-config 'strategy="scaffold"'
#   ./scripts/deploy.sh --tls            # TLS everywhere + SuperNode authentication (keys from make_certs.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m fl_app.deploy "$@"
