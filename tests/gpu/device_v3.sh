#!/bin/bash
# One device session for the v3 forward: correctness, memcheck, SASS check, timings, and the
# cuDNN peer in the same session. Binaries are built on the CPU machine (see harness_v3.cu) and
# carried in .carry/. Logs go to $OUT (the device tool brings them back).
#
#   [HARNESS=.carry/other_build] bash tests/gpu/device_v3.sh [steps...]
#   steps: check bench cudnn memcheck (default: all); logs are named after the harness binary.
set -u
OUT=${OUT:-/tmp/v3_device}
mkdir -p "$OUT"
HARNESS=${HARNESS:-.carry/harness_v3}
TAG=$(basename "$HARNESS")
STEPS=${*:-check bench cudnn memcheck}
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv,noheader | tee "$OUT/gpu.txt"
summary "HGMMA in harness SASS: $(cuobjdump --dump-sass $HARNESS | grep -c HGMMA)," \
  "local memory ops: $(cuobjdump --dump-sass $HARNESS | grep -cE 'LDL|STL')"

for step in $STEPS; do
  start=$(date +%s)
  case $step in
    check)
      timeout 60 $HARNESS check >"$OUT/$TAG.check.log" 2>&1
      rc=$?
      summary "$TAG check rc=$rc ($(grep -c '^ok' "$OUT/$TAG.check.log") ok, $(grep -c '^FAIL' "$OUT/$TAG.check.log") FAIL)"
      grep -E '^FAIL|failed|error' "$OUT/$TAG.check.log" | head -20
      if [ $rc -eq 124 ]; then  # a hang: rerun the debug build (${HARNESS}_hangtrap, built
        # with -DJAX_FLASH_V3_HANG_TRAP), whose waits trap and report
        timeout 60 "${HARNESS}_hangtrap" small >"$OUT/hang.log" 2>&1
        summary "hang-trap build rc=$?"; head -30 "$OUT/hang.log"
        exit 1
      fi ;;
    bench)
      timeout 100 $HARNESS bench >"$OUT/$TAG.bench.log" 2>&1
      summary "$TAG bench rc=$? ($(grep -c '^FAIL' "$OUT/$TAG.bench.log") FAIL)"
      grep -E '^FAIL' "$OUT/$TAG.bench.log" | head; sed -n '/v3 forward TFLOP/,$p' "$OUT/$TAG.bench.log" ;;
    cudnn)
      PYTHONUNBUFFERED=1 timeout 150 python3 tests/gpu/peer_cudnn_fwd.py >"$OUT/cudnn.log" 2>&1
      summary "cudnn rc=$?"; grep -E 'kernel=' "$OUT/cudnn.log" | head -2 | cut -c1-200
      sed -n '/forward TFLOP/,$p' "$OUT/cudnn.log" ;;
    memcheck)
      timeout 120 compute-sanitizer --tool memcheck $HARNESS small >"$OUT/$TAG.memcheck.log" 2>&1
      summary "$TAG memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/$TAG.memcheck.log" | tail -1)"
      grep -E '^FAIL|Invalid|ERROR' "$OUT/$TAG.memcheck.log" | head -5 ;;
  esac
  summary "$step took $(( $(date +%s) - start )) s"
done
