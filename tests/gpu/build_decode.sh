#!/bin/bash
# Builds tests/gpu/harness_decode.cu + cuda/decode.cu into .carry/harness_decode (static cudart:
# built here on the CPU machine, runs on the H200 unchanged). The decode kernels are compute_80
# code (mma.sync, cp.async), compiled to sm_80 and sm_90 SASS as CMakeLists.txt does for
# cuda/*.cu; the ptxas report of the split-KV kernels goes to $BUILD/decode_ptxas.txt.
#   bash tests/gpu/build_decode.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-/tmp/harness_decode_build}
mkdir -p "$BUILD" .carry
FLAGS="-O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_80,code=sm_90"
nvcc $FLAGS -Xptxas -v -c cuda/decode.cu -o "$BUILD/decode.o" 2> "$BUILD/decode_ptxas.txt"
nvcc $FLAGS -c tests/gpu/harness_decode.cu -o "$BUILD/harness_decode.o"
nvcc $FLAGS "$BUILD/harness_decode.o" "$BUILD/decode.o" -o .carry/harness_decode
# The split-KV kernels for sm_90: registers and spills (a spill in the streaming loop costs).
grep -A2 "split_kv_kernel.*sm_90" "$BUILD/decode_ptxas.txt" | grep -E "spill|Used" | sort | uniq -c
echo "built .carry/harness_decode"
