#!/usr/bin/env bash
# Set up (first time only), then run one experiment on docker-compose.yml's topology as local processes:
# a SuperLink, N SuperNodes and their SuperExecs on 127.0.0.1, `flwr run` against them, everything stopped after
# (also on Ctrl-C, SIGTERM or SIGHUP). A service that exits during the run is reported with its exit code and log;
# without its SuperLink the run stops, and the command that resumes it (resume-from) is printed.
# Exits non-zero if the run failed. The services' logs go to the run folder's logs/; nothing stays in $TMPDIR.
#   ./scripts/deploy.sh --num-supernodes 3 --rounds 5 --run-config 'strategy="scaffold"'
#   ./scripts/deploy.sh --tls            # TLS everywhere + SuperNode authentication (keys from make_certs.sh)
#   ./scripts/deploy.sh --executor flower  # Flower's own executor: a fresh flwr-clientapp process per message
#                                          # (default: warm, each forked from a process that imported them once)
#   ./scripts/deploy.sh --node-poll flower  # Flower's own SuperNode: asks for messages every 3 s (default: 0.5 s)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m alignfl.fl_app.deploy "$@"
