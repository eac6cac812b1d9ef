#!/usr/bin/env bash
# On a machine with one CUDA GPU: the CUDA-marked tests, then the cross-device benchmark on the GPU (device=auto),
# its table printed at the end. At most 8 minutes; run from anywhere:  scripts/gpu_check.sh [extra benchmark flags]
# PY picks the interpreter (default: the checkout's .venv), e.g. PY=python3; PYTHONPATH given is kept, after the
# checkout. Where Ray is not importable, the slow (Ray) CUDA test and the benchmark's ray engine are left out
# (--engines inprocess,batched,vectorised,plain, before the flags given, which can name others).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 FLWR_TELEMETRY_ENABLED=0
cd "$ROOT"
"$PY" - <<'PYCHECK'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device here; run it on a machine with a GPU")
print(f"gpu_check.sh: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PYCHECK
OUT="${OUT:-$(mktemp -d /tmp/alignfl-gpu-check-XXXXXX)}"
# the CNN and the 2NN by default (the 1024-wide MLP too: --models twonn,mlp,twocnn, beyond 8 minutes with Ray)
[ $# -eq 0 ] && set -- --models twonn,twocnn
MARKS=cuda BENCH_S=390
if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("ray") is None)'; then
    echo "gpu_check.sh: Ray is not importable: leaving out the slow (Ray) CUDA test and the ray engine"
    MARKS="cuda and not slow" BENCH_S=300  # no Ray start-ups: at most 6.5 minutes
    set -- --engines inprocess,batched,vectorised,plain "$@"
fi
timeout 90 "$PY" -m pytest -q -n 0 -m "$MARKS" tests/test_cuda.py
timeout "$BENCH_S" "$PY" benchmarks/cross_device.py --out "$OUT" "$@"
echo "gpu_check.sh: table in $OUT/report.md"
