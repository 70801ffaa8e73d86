#!/bin/bash
# Builds tests/gpu/harness_v3_bwd.cu with -DJAX_FLASH_V3_BWD_TIMELINE into
# .carry/harness_v3_bwd_timeline: build_v3_bwd.sh's objects, with the main backward kernel
# stamping a timeline (cuda/v3.h, v3_bwd_timeline) and the harness's --timeline mode. A
# measurement build only: the library and build_v3_bwd.sh never define the macro.
#   bash tests/gpu/build_v3_bwd_timeline.sh            (CUTLASS=<include dir> to override)
set -euo pipefail
cd "$(dirname "$0")/../.."
CUTLASS=${CUTLASS:-$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__) + '/source/include')")}
BUILD=${BUILD:-/tmp/harness_v3_bwd_timeline_build}
mkdir -p "$BUILD" .carry
HOPPER="-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I$CUTLASS -DJAX_FLASH_V3_BWD_TIMELINE"
AMPERE="-O3 -std=c++17 -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_80,code=sm_90"
nvcc $HOPPER -Xptxas -v -c cuda/v3_bwd_sm90.cu -o "$BUILD/v3_bwd_sm90.o" 2> "$BUILD/v3_bwd_ptxas.txt"
nvcc $HOPPER -c cuda/v3_fwd_sm90.cu -o "$BUILD/v3_fwd_sm90.o"
nvcc $HOPPER -c tests/gpu/harness_v3_bwd.cu -o "$BUILD/harness_v3_bwd.o"
nvcc $AMPERE -c cuda/backward.cu -o "$BUILD/backward.o"
nvcc -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_90 \
  "$BUILD/harness_v3_bwd.o" "$BUILD/v3_bwd_sm90.o" "$BUILD/v3_fwd_sm90.o" "$BUILD/backward.o" \
  -o .carry/harness_v3_bwd_timeline
# Spills of the instrumented kernels. nvcc 13.0: as the default build (H = 64 main kernels 8
# bytes stored, 24 / 32 loaded; none elsewhere) plus 4 / 4 bytes in each H = 128 main kernel,
# one register around the helper's softcap branch (not run by the --timeline configs):
grep -E "spill|Used" "$BUILD/v3_bwd_ptxas.txt" | sort | uniq -c
echo "built .carry/harness_v3_bwd_timeline"
