"""Energy per call of the bench's implementations under a sustained loop (the 700 W power cap).

The bench's sustained medians sit under the kernels' trace rates because the H200 hits its
software power cap; a kernel that spends more energy per FLOP is clocked down further. This
runs each implementation alone in a back-to-back loop for a few seconds (after a warm-up that
reaches the cap) while nvidia-smi samples power and SM clock, and prints per phase: ms per call,
mean power, mean clock, joules per call. Any implementation the bench knows works (v1, v2, v3,
cudnn, torch_flash, torch_cudnn, ...), built and called exactly as the bench builds it.

  python3 tests/gpu/power_probe.py [--seconds 3] [--heads 128] [--seqlen 16384] [--mode fwd]
      [--impl v3,cudnn,v3,cudnn]
"""
from __future__ import annotations

import argparse
import subprocess
import time

import jax  # before the extension (DEVICE.md: the other order segfaulted on jax 0.11)

from jax_flash.bench.configs import Case
from jax_flash.bench.inputs import make_set
from jax_flash.bench.peers import all_peers
from jax_flash.bench.steps import prepare


def _loop(prepared, seconds: float) -> tuple[float, float, float, int]:
  """Back-to-back calls for about `seconds`; (start, end, seconds per call, calls)."""
  prepared.run_once()
  start = time.time()
  t0, calls, out = time.perf_counter(), 0, None
  while time.perf_counter() - t0 < seconds:
    for _ in range(8):
      out = prepared.call(0)
    calls += 8
    prepared.wait(out)
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
  p.add_argument("--impl", default="v3,cudnn,v3,cudnn",
                 help="comma-separated bench implementations, run in this order (repeats allowed)")
  p.add_argument("--log", default="/tmp/power_probe_smi.csv")
  a = p.parse_args()
  num_heads = 2048 // a.heads
  case = Case(mode=a.mode, batch=16384 // a.seqlen, q_len=a.seqlen, kv_len=a.seqlen,
              num_heads=num_heads, num_kv_heads=num_heads, head_dim=a.heads, causal=a.causal,
              dtype="bfloat16")
  flops = case.flops()
  inputs = make_set(case, jax.random.key(0))
  names = a.impl.split(",")
  by_name = {peer.name: peer for peer in all_peers(jax.default_backend())[0]}
  missing = [n for n in names if n not in by_name]
  if missing:
    raise ValueError(f"--impl: {missing} not available here (available: {sorted(by_name)})")
  prepared = {name: prepare(by_name[name], case, [inputs], inputs) for name in set(names)}
  smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,power.draw,clocks.sm",
                          "--format=csv,noheader", "-lms", "100"],
                         stdout=open(a.log, "w"), stderr=subprocess.DEVNULL)
  try:
    phases = []
    for name in names:
      _loop(prepared[name], 1.0)  # reach the power cap
      phases.append((name, *_loop(prepared[name], a.seconds)))
  finally:
    time.sleep(0.3)
    smi.terminate()
    smi.wait()
  samples = _samples(a.log)
  print(f"{a.mode} {case.label}; {len(samples)} smi samples")
  print(f"{'impl':12s} {'ms/call':>8s} {'TFLOP/s':>8s} {'W':>6s} {'MHz':>6s} {'J/call':>7s} "
        f"{'TFLOP/J':>8s} samples")
  for name, start, end, per_call, calls in phases:
    inside = [(w, mhz) for t, w, mhz in samples if start + 0.2 <= t <= end]
    if not inside:
      print(f"{name:12s} {per_call * 1e3:8.3f}  (no smi samples)")
      continue
    watts = sum(w for w, _ in inside) / len(inside)
    mhz = sum(m for _, m in inside) / len(inside)
    joules = watts * per_call
    print(f"{name:12s} {per_call * 1e3:8.3f} {flops / per_call / 1e12:8.1f} {watts:6.1f} "
          f"{mhz:6.0f} {joules:7.3f} {flops / joules / 1e12:8.3f} {len(inside)} ({calls} calls)")


if __name__ == "__main__":
  main()
