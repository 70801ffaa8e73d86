#!/usr/bin/env bash
# One device session: build the extension on the GPU machine, run the GPU tests, benchmark.
#   bash tests/gpu/run_device.sh [STAGE...]
#     stages: build tests bench v1 (default), train, and on a 2-GPU machine: sharding ring
# Run from the repository root with `.carry` (holding the nvidia-cutlass wheel) carried along.
# Writes build and test logs, the bench outputs (json + txt) and a clock / power log (smi.csv)
# under $OUT (or /tmp/jf_out): at most 7 files from the default stages.
# Knobs (env): BENCH_MODES, BENCH_IMPL, BENCH_REPEATS, BENCH_MAX_SECONDS, TEST_FILTER (pytest -k),
# TRAIN_STEPS, TRAIN_ROUNDS, and a *_TIMEOUT per stage (PROFILE_TIMEOUT: the train stage's
# kernel-by-kernel profile, tests/gpu/train_profile.py).
set -uo pipefail
OUT=${OUT:-/tmp/jf_out}
mkdir -p "$OUT"
stages=${*:-build tests bench v1}
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on the shared hosts
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site
has() { [[ " $stages " == *" $1 "* ]]; }

if has build; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/cutlass .carry/nvidia_cutlass-*.whl
  start=$SECONDS
  PYTHONPATH=/tmp/cutlass CMAKE_BUILD_PARALLEL_LEVEL=16 JAX_FLASH_CUDA=ON \
    python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site . \
    > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build: $((SECONDS - start)) s"
  python3 -c "import jax, jax_flash; print(jax.devices()); [print(s) for s in jax_flash.schedules()]"
fi
if has tests; then
  timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q -p no:cacheprovider --durations=10 \
    tests/test_attention.py tests/test_decode.py tests/test_extension.py tests/test_gpu_v1v2.py \
    -k "${TEST_FILTER:-not cpu}" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -25
fi
# The grid of BENCHMARK.md, every mode, the peers in the same run. 3 repeats (the bench's GPU
# default is 5) of 0.2 s, each after its 0.2 s settle, take about as long per case (1.2 s) as
# 5 of 50 ms did before session 37 (1.25 s).
if has bench; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv,noheader -lms 250 > "$OUT/smi.csv" 2>&1 &
  smi=$!
  timeout ${BENCH_TIMEOUT:-480} python3 -m jax_flash.bench --mode ${BENCH_MODES:-decode,fwd,fwdbwd} \
    --impl ${BENCH_IMPL:-v2,v3,cudnn,torch_cudnn,torch_flash,flash_decode,xla} --xla-max-seqlen 1 \
    --repeats ${BENCH_REPEATS:-3} --max-seconds ${BENCH_MAX_SECONDS:-300} --out "$OUT/bench" > /tmp/bench.log 2>&1
  rc=$?; echo "bench rc=$rc"; sed -n '/^== /,$p' /tmp/bench.log | head -80
  # A stalled case leaves every thread's stack in the log (the bench's --stall-dump-s).
  if [ $rc -ne 0 ]; then grep -A40 "^Timeout (" /tmp/bench.log | tail -60; fi
  kill $smi
  rm -f "$OUT"/bench/*.png  # re-rendered off the device: python -m jax_flash.bench --from-json
fi
if has v1; then  # FlashAttention-1 against -2 on the grid's H=128 rows, forward
  timeout ${V1_TIMEOUT:-150} python3 -m jax_flash.bench --mode fwd --heads 128 --impl v1,v2 \
    --repeats 3 --no-ceilings --out "$OUT/bench_v1" > /tmp/bench_v1.log 2>&1
  echo "v1 rc=$?"; sed -n '/^== /,$p' /tmp/bench_v1.log | head -20
  rm -f "$OUT"/bench_v1/*.png
fi
if has train; then  # issue #5: a training step of the example model, v3 against cuDNN, alternated
  args="--dtype bfloat16 --steps ${TRAIN_STEPS:-40} --batch 4 --seq-len 4096 --d-model 2048 --heads 16"
  args+=" --layers 1 --lr 3e-4 --log-every 1000"
  for round in $(seq ${TRAIN_ROUNDS:-2}); do
    for attention in "direct --schedule v3" "cudnn"; do
      timeout 120 python3 examples/train.py $args --attention $attention 2>&1 | grep "^done" \
        | tee -a "$OUT/train.log"
    done
  done
  timeout ${PROFILE_TIMEOUT:-180} python3 tests/gpu/train_profile.py > "$OUT/train_profile.log" 2>&1
  echo "train_profile rc=$?"; sed -n '/device time per step/p;/INCOMPLETE TRACE/p;/^largest/,$p' "$OUT/train_profile.log"
fi
if has sharding; then
  timeout ${SHARDING_TIMEOUT:-150} python3 -m pytest -q -s -p no:cacheprovider \
    tests/test_sharding.py tests/test_flax.py > "$OUT/sharding.log" 2>&1
  echo "sharding rc=$?"; grep -E "devices|passed|failed|FAILED" "$OUT/sharding.log" | tail -25
fi
if has ring; then
  timeout ${RING_TIMEOUT:-150} python3 examples/ring_benchmark.py --mode fwd,fwdbwd \
    > "$OUT/ring.log" 2>&1
  echo "ring rc=$?"; tail -30 "$OUT/ring.log"
fi
