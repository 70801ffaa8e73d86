#!/bin/bash
# ncu, our v3 kernel against cuDNN's (or, with IMPLS="v2 torch_flash", v2 against PyTorch's
# FlashAttention-2) on one shape, one call each (tests/gpu/ncu_probe.py):
# launch facts, throughput, warp states, instruction counts, and for both kernels the
# per-instruction SASS page (cuDNN's has no source lines, its SASS and stall samples are there),
# summarized by tests/gpu/ncu_source_summary.py. On the GPU machine, from the repository root,
# after `bash tests/gpu/run_device.sh build` (the extension in /tmp/site):
#   bash tests/gpu/ncu_compare.sh fwd|bwd B T N K H CAUSAL [PER]
# PER: units of work for per-unit counts (e.g. the backward's 64 x 128 steps). Writes
# $OUT/ncu_<mode>_<shape>_<impl>.txt and ncu_<mode>_<shape>_<impl>_sass.csv (4 files).
set -u
mode=$1; shift; shape="$1 $2 $3 $4 $5 $6"; per=${7:-}
tag="ncu_${mode}_$(echo $shape | tr ' ' '_')"
OUT=${OUT:-/tmp/jf_out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=${PYTHONPATH:-/tmp/site}
SECTIONS="--section LaunchStats --section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis
  --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats"
IMPLS=${IMPLS:-v3 cudnn}
declare -A kernel=([v3_fwd]=v3_forward_kernel [v3_bwd]=v3_backward_kernel [cudnn_fwd]=fprop
  [cudnn_bwd]=bprop [v2_fwd]=v2_forward_kernel [v2_bwd]=dkdv_kernel
  [torch_flash_fwd]=flash_fwd_kernel [torch_flash_bwd]=flash_bwd_dq_dk_dv)
for impl in $IMPLS; do
  # ncu_probe makes two calls: the second, warm one is profiled.
  timeout 240 ncu --clock-control none $SECTIONS --section SourceCounters -o /tmp/${tag}_$impl -f \
    --kernel-name regex:"${kernel[${impl}_$mode]}" --launch-skip 1 --launch-count 1 \
    python3 tests/gpu/ncu_probe.py $impl $mode $shape > "$OUT/${tag}_$impl.txt" 2>&1
  echo "ncu $impl $mode $shape rc=$?"
  [ -f /tmp/${tag}_$impl.ncu-rep ] || continue
  ncu -i /tmp/${tag}_$impl.ncu-rep --page details >> "$OUT/${tag}_$impl.txt" 2>&1
  ncu -i /tmp/${tag}_$impl.ncu-rep --page source --csv --print-source sass \
    > "$OUT/${tag}_${impl}_sass.csv"
  python3 tests/gpu/ncu_source_summary.py "$OUT/${tag}_${impl}_sass.csv" ${per:+--per $per} \
    --top 15 >> "$OUT/${tag}_$impl.txt"
done
for impl in $IMPLS; do
  echo "== $impl"
  grep -E "^  [a-z_].*\(|Duration|SM Frequency|Executed Instructions |Issue Slots Busy|Compute \(SM\) Thr|Grid Size|Block Size|Registers Per|Dynamic Shared Memory Per|L2 Hit Rate " \
    "$OUT/${tag}_$impl.txt" | awk '{$1=$1};1' | cut -c1-120 | sort -u
done
