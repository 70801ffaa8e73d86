#!/bin/bash
# Builds tests/gpu/harness_v3.cu twice:
#   .carry/harness_v3_timeline  -DJAX_FLASH_V3_FWD_TIMELINE: the forward kernel stamping a
#                               timeline (cuda/v3.h, v3_fwd_timeline) and the --timeline mode;
#                               library default tuning only (the instantiations it records)
#   .carry/harness_v3           the default build (harness_v3.cu's line, every tuning
#                               variant): the perturbation baseline (--bench-one)
# A measurement build only: the library and the other build scripts never define the macro.
#   bash tests/gpu/build_v3_timeline.sh            (CUTLASS=<include dir> to override)
set -euo pipefail
cd "$(dirname "$0")/../.."
CUTLASS=${CUTLASS:-$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__) + '/source/include')")}
BUILD=${BUILD:-/tmp/harness_v3_timeline_build}
mkdir -p "$BUILD" .carry
HOPPER="-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I$CUTLASS"
build() {  # name, extra flags: kernel object (ptxas report kept), harness object, link
  local name=$1
  shift
  nvcc $HOPPER "$@" -Xptxas -v -c cuda/v3_fwd_sm90.cu -o "$BUILD/$name.fwd.o" \
    2> "$BUILD/$name.ptxas.txt"
  nvcc $HOPPER "$@" -c tests/gpu/harness_v3.cu -o "$BUILD/$name.harness.o"
  nvcc -gencode=arch=compute_90a,code=sm_90a "$BUILD/$name.harness.o" "$BUILD/$name.fwd.o" \
    -o ".carry/$name"
}
build harness_v3_timeline -DJAX_FLASH_V3_FWD_TIMELINE &
timeline_build=$!
build harness_v3 -DJAX_FLASH_V3_TUNING_VARIANTS
wait $timeline_build
# Spills and register counts per kernel. nvcc 13.0: none in either build (all 0 bytes), the
# timeline build adds 16 bytes of static shared memory (the record pointer).
for name in harness_v3_timeline harness_v3; do
  echo "$name:"
  grep -E "spill|Used" "$BUILD/$name.ptxas.txt" | sort | uniq -c
done
echo "built .carry/harness_v3_timeline .carry/harness_v3"
