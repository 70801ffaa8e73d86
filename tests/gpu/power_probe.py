"""Energy per call of v3 and of cuDNN under a sustained loop (the board's 700 W power cap).

The bench's sustained medians sit under the kernels' trace rates because the H200 hits its
software power cap; a kernel that spends more energy per FLOP is clocked down further. This
runs each implementation alone in a back-to-back loop for a few seconds (after a warm-up that
reaches the cap) while nvidia-smi samples power and SM clock, and prints per phase: ms per call,
mean power, mean clock, joules per call.

  python3 tests/gpu/power_probe.py [--seconds 3] [--heads 128] [--seqlen 16384] [--mode fwd]
"""
from __future__ import annotations

import argparse
import subprocess
import time

import jax
import jax.numpy as jnp

import jax_flash


def _attention(impl: str, causal: bool):
  if impl == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="cudnn")
  return lambda q, k, v: jax_flash.flash_attention(q, k, v, is_causal=causal, schedule=impl)


def _step(impl: str, mode: str, causal: bool):
  attend = _attention(impl, causal)
  if mode == "fwd":
    return jax.jit(attend)
  loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _loop(fn, args, seconds: float) -> tuple[float, float, float, int]:
  """Back-to-back calls for about `seconds`; (start, end, seconds per call, calls)."""
  jax.block_until_ready(fn(*args))
  start = time.time()
  t0, calls, out = time.perf_counter(), 0, None
  while time.perf_counter() - t0 < seconds:
    for _ in range(8):
      out = fn(*args)
    calls += 8
    jax.block_until_ready(out)
  elapsed = time.perf_counter() - t0
  return start, time.time(), elapsed / calls, calls


def _samples(path: str):
  rows = []
  for line in open(path):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 3 or not parts[1].endswith("W"):
      continue
    stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
    stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
    rows.append((stamp, float(parts[1].split()[0]), float(parts[2].split()[0])))
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--heads", type=int, default=128, help="head dim H")
  p.add_argument("--seqlen", type=int, default=16384)
  p.add_argument("--causal", action="store_true")
  p.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
  p.add_argument("--impl", default="v3,cudnn,v3,cudnn")
  p.add_argument("--log", default="/tmp/power_probe_smi.csv")
  a = p.parse_args()
  b, n = 16384 // a.seqlen, 2048 // a.heads
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, (b, a.seqlen, n, a.heads), jnp.bfloat16) for key in keys)
  flops = 4 * b * n * a.seqlen * a.seqlen * a.heads * (0.5 if a.causal else 1.0)
  flops *= 3.5 if a.mode == "fwdbwd" else 1.0
  smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,power.draw,clocks.sm",
                          "--format=csv,noheader", "-lms", "100"],
                         stdout=open(a.log, "w"), stderr=subprocess.DEVNULL)
  try:
    phases = []
    for impl in a.impl.split(","):
      fn = _step(impl, a.mode, a.causal)
      _loop(fn, (q, k, v), 1.0)  # compile, then reach the power cap
      phases.append((impl, *_loop(fn, (q, k, v), a.seconds)))
  finally:
    time.sleep(0.3)
    smi.terminate()
    smi.wait()
  samples = _samples(a.log)
  print(f"{a.mode} B{b} T{a.seqlen} N{n} H{a.heads} causal={a.causal} bf16; "
        f"{len(samples)} smi samples")
  print(f"{'impl':8s} {'ms/call':>8s} {'TFLOP/s':>8s} {'W':>6s} {'MHz':>6s} {'J/call':>7s} "
        f"{'TFLOP/J':>8s} samples")
  for impl, start, end, per_call, calls in phases:
    inside = [(w, mhz) for t, w, mhz in samples if start + 0.2 <= t <= end]
    if not inside:
      print(f"{impl:8s} {per_call * 1e3:8.3f}  (no smi samples)")
      continue
    watts = sum(w for w, _ in inside) / len(inside)
    mhz = sum(m for _, m in inside) / len(inside)
    joules = watts * per_call
    print(f"{impl:8s} {per_call * 1e3:8.3f} {flops / per_call / 1e12:8.1f} {watts:6.1f} "
          f"{mhz:6.0f} {joules:7.3f} {flops / joules / 1e12:8.3f} {len(inside)} ({calls} calls)")


if __name__ == "__main__":
  main()
