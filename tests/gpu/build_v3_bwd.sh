#!/bin/bash
# Builds tests/gpu/harness_v3_bwd.cu into .carry/harness_v3_bwd (static cudart: built here on the
# CPU machine, runs on the H200 unchanged): the v3 forward and backward for sm_90a, the v2
# backward (cuda/backward.cu) as in the library, compute_80 code for sm_90 (and sm_80).
#   bash tests/gpu/build_v3_bwd.sh            (CUTLASS=<include dir> to override)
# HARNESS_FLAGS (extra nvcc flags for the sm_90a objects) and HARNESS_NAME (the binary's name)
# make the measurement builds (build_v3_bwd_timeline.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
CUTLASS=${CUTLASS:-$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__) + '/source/include')")}
NAME=${HARNESS_NAME:-harness_v3_bwd}
BUILD=${BUILD:-/tmp/${NAME}_build}
mkdir -p "$BUILD" .carry
HOPPER="-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I$CUTLASS ${HARNESS_FLAGS:-}"
AMPERE="-O3 -std=c++17 -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_80,code=sm_90"
nvcc $HOPPER -Xptxas -v -c cuda/v3_bwd_sm90.cu -o "$BUILD/v3_bwd_sm90.o" 2> "$BUILD/v3_bwd_ptxas.txt"
nvcc $HOPPER -c cuda/v3_fwd_sm90.cu -o "$BUILD/v3_fwd_sm90.o"
nvcc $HOPPER -c tests/gpu/harness_v3_bwd.cu -o "$BUILD/harness_v3_bwd.o"
nvcc $AMPERE -c cuda/backward.cu -o "$BUILD/backward.o"
nvcc -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_90 \
  "$BUILD/harness_v3_bwd.o" "$BUILD/v3_bwd_sm90.o" "$BUILD/v3_fwd_sm90.o" "$BUILD/backward.o" \
  -o ".carry/$NAME"
# The main backward kernel must not spill (ptxas report of cuda/v3_bwd_sm90.cu):
grep -E "spill|Used" "$BUILD/v3_bwd_ptxas.txt" | sort | uniq -c
echo "built .carry/$NAME"
