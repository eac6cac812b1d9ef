#!/usr/bin/env bash
# On a machine with one CUDA GPU: the CUDA-marked tests, then the cross-device benchmark on the GPU (device=auto),
# its table printed at the end. At most 8 minutes; run from anywhere:  scripts/gpu_check.sh [extra benchmark flags]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
export PYTHONPATH="$ROOT" OMP_NUM_THREADS=1 FLWR_TELEMETRY_ENABLED=0
cd "$ROOT"
"$PY" - <<'PYCHECK'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device here; run it on a machine with a GPU")
print(f"gpu_check.sh: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PYCHECK
OUT="${OUT:-$(mktemp -d /tmp/alignfl-gpu-check-XXXXXX)}"
timeout 90 "$PY" -m pytest -q -n 0 -m cuda tests/test_cuda.py
# the CNN and the 2NN by default (the 1024-wide MLP too: --models twonn,mlp,twocnn, beyond 8 minutes with Ray)
[ $# -eq 0 ] && set -- --models twonn,twocnn
timeout 390 "$PY" benchmarks/cross_device.py --out "$OUT" "$@"
echo "gpu_check.sh: table in $OUT/report.md"
