#!/usr/bin/env bash
# The replica's checks on a GPU, in one go (CI has none; services/kvpool/README.md "On a GPU").
#
#   scripts/gpu-check.sh [OUT_DIR]        (PYTHON=... for a Python whose torch sees CUDA)
#
# Needs the project's packages importable by that Python (`pip install -e .` or PYTHONPATH=.)
# and a torch built for CUDA (the CPU pin of `make setup` has none). Runs, with
# TIERCACHE_TEST_DEVICE / --device set to DEVICE (default cuda):
#   1. pytest tests/device        exactness of every reuse path on the device
#   2. benchmarks.device          the near pairs' reuse paths compared and drafts timed
#   3. benchmarks.step_profile    a decode step's time, kernels launched, GPU busy time
# and writes their logs and JSON into OUT_DIR (default ./gpu-check-<date>, made where it is
# run). Exits non-zero if any of them failed (each still runs).
set -u
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
PAIRS=${PAIRS:-12}
OUT=${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT" || exit 3
OUT=$(cd "$OUT" && pwd)
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # before the cd
cd "$(dirname "$0")/.." || exit 3  # tests/ and benchmarks/ are found from the repository root
export PYTHONUNBUFFERED=1
DEVICE=$DEVICE "$PY" -c "
import os, sys
import torch
dev = os.environ['DEVICE']
print('torch', torch.__version__, 'cuda', torch.cuda.is_available())
if dev != 'cpu' and not torch.cuda.is_available():
    sys.exit(\"this Python's torch sees no CUDA device (set PYTHON=...)\")
" || exit 3
rc=0
step() {  # step LOG LINES COMMAND...: runs it, its output kept in $OUT/LOG, the last LINES shown
    local log=$1 lines=$2
    shift 2
    "$@" 2>&1 | tee "$OUT/$log" | tail -"$lines"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
}
step pytest.log 15 env TIERCACHE_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider \
    -rA tests/device
step device.log 20 "$PY" -m benchmarks.device --device "$DEVICE" --pairs "$PAIRS" \
    --out "$OUT/device_${DEVICE%%:*}.json"
step step_profile.log 5 "$PY" -m benchmarks.step_profile --device "$DEVICE" \
    --out "$OUT/step_profile_${DEVICE%%:*}.json"
echo "gpu-check: $( [ $rc -eq 0 ] && echo passed || echo FAILED ); logs and results in $OUT"
exit $rc
