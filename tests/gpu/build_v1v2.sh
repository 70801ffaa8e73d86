#!/bin/bash
# Builds tests/gpu/harness_v1v2.cu into .carry/harness_v1v2 (static cudart: built here on the CPU
# machine, runs on the H200 unchanged): the v1 / v2 kernels as compute_80 code, run as sm_80
# and sm_90 machine code, exactly as the library builds them.
#   bash tests/gpu/build_v1v2.sh          the harness (check, --quick, --bench, --profile)
#   TUNE=1 bash tests/gpu/build_v1v2.sh   also --tune (v2.cu and backward.cu are included by
#                                         the harness to instantiate the alternative schedules)
# The ptxas report (registers, spills) of every kernel is left in $BUILD/ptxas_*.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-/tmp/harness_v1v2_build}
OUT=${OUT_BIN:-.carry/harness_v1v2}
mkdir -p "$BUILD" "$(dirname "$OUT")"
FLAGS="-O3 -std=c++17 -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_80,code=sm_90"
if [ "${TUNE:-0}" = 1 ]; then
  SOURCES="tests/gpu/harness_v1v2.cu cuda/v1.cu"
  FLAGS="$FLAGS -DJAX_FLASH_TUNE"
else
  SOURCES="tests/gpu/harness_v1v2.cu cuda/v1.cu cuda/v2.cu cuda/backward.cu"
fi
OBJECTS=""
for src in $SOURCES; do
  name=$(basename "$src" .cu)
  nvcc $FLAGS -Xptxas -v -c "$src" -o "$BUILD/$name.o" 2> "$BUILD/ptxas_$name.txt" &
  OBJECTS="$OBJECTS $BUILD/$name.o"
done
for job in $(jobs -p); do wait "$job" || { grep -h -A3 "error" "$BUILD"/ptxas_*.txt; exit 1; }; done
nvcc -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_80,code=sm_90 $OBJECTS -o "$OUT"
# Registers and spill bytes of each kernel's sm_90 machine code (the H200 runs that one):
awk '/Compiling entry function/ { split($0, a, "\047"); name = a[2]; arch = a[4] }
     /spill stores/ { spill = $5 }
     /Used [0-9]+ registers/ { if (arch == "sm_90") { sub(/.*Used /, ""); print $1, spill, name } }' \
  "$BUILD"/ptxas_*.txt | c++filt | sed -E 's/jax_flash::\(anonymous namespace\):://g; s/\(jax_flash::[^)]*\)$//' |
  awk '{ printf "  regs %3d  spill %4d  ", $1, $2; $1 = $2 = ""; print substr($0, 3) }' | sort -k6 | uniq
echo "built $OUT"
