#!/usr/bin/env bash
# Set up (first time only) and run one experiment with `flwr run` on a private local SuperLink.
# Default: FedAvg, MLP, Fashion-MNIST, 10 clients, Dirichlet 0.5, 10 rounds. Exits non-zero if the run failed.
#   ./scripts/run.sh --num-supernodes 10 --run-config "strategy=\"fedprox\" dirichlet-alpha=0.1"
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m alignfl.fl_app.launch "$@"
