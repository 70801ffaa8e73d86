"""Energy per call of the bench's implementations under a sustained loop (the 700 W power cap).

The bench's sustained medians sit under the kernels' trace rates because the H200 hits its
software power cap; a kernel that spends more energy per FLOP is clocked down further. This
runs each implementation alone in a back-to-back loop for a few seconds (after a warm-up that
reaches the cap) while nvidia-smi samples power, SM clock and temperature, and prints per phase:
ms per call, mean power, mean clock, joules per call. Any implementation the bench knows works
(v1, v2, v3, cudnn, torch_flash, torch_cudnn, ...), built and called exactly as the bench builds
it.

  --interval S   also the rate, power, clock and temperature of each S-second part of the loop
                 (how the card settles: does the rate fall as the chip warms?)
  --trace-calls N  after each phase, N more back-to-back calls inside a profiler trace: the
                 device time of their kernels against the span from the first kernel's start to
                 the last one's end (idle device time between calls, which the bench's host loop
                 counts and the kernels' own time does not), and the largest gap

  python3 tests/gpu/power_probe.py [--seconds 3] [--heads 128] [--seqlen 16384] [--mode fwd]
      [--impl v3,cudnn,v3,cudnn] [--interval 1] [--trace-calls 20]
"""
from __future__ import annotations

import argparse
import subprocess
import time

import jax  # before the extension (DEVICE.md: the other order segfaulted on jax 0.11)

from jax_flash.bench import kernels
from jax_flash.bench.configs import Case
from jax_flash.bench.inputs import make_set
from jax_flash.bench.peers import all_peers
from jax_flash.bench.steps import prepare


def _loop(prepared, seconds: float, calls_per_wait: int) -> tuple[float, list[tuple[float, int]]]:
  """Back-to-back calls for about `seconds`, waiting after every `calls_per_wait`; (wall-clock
  start, [(perf_counter, calls so far)]) with a stamp at the start and after each wait."""
  prepared.run_once()
  start = time.time()
  t0 = time.perf_counter()
  stamps, calls, out = [(t0, 0)], 0, None
  while stamps[-1][0] - t0 < seconds:
    for _ in range(calls_per_wait):
      out = prepared.call(0)
    calls += calls_per_wait
    prepared.wait(out)
    stamps.append((time.perf_counter(), calls))
  return start, stamps


def _parts(stamps: list[tuple[float, int]], interval: float) -> list[tuple[float, float, float]]:
  """(offset_start_s, offset_end_s, seconds per call) of consecutive parts of about `interval`."""
  parts, first = [], stamps[0]
  for stamp in stamps[1:]:
    if stamp[0] - first[0] >= interval or stamp is stamps[-1]:
      parts.append((first[0] - stamps[0][0], stamp[0] - stamps[0][0],
                    (stamp[0] - first[0]) / (stamp[1] - first[1])))
      first = stamp
  return parts


def _samples(path: str) -> list[tuple[float, float, float, float]]:
  """(unix time, W, MHz, °C) of each nvidia-smi line."""
  rows = []
  for line in open(path):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 4 or not parts[1].endswith("W"):
      continue
    stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
    stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
    rows.append((stamp, float(parts[1].split()[0]), float(parts[2].split()[0]), float(parts[3])))
  return rows


def _trace_gaps(prepared, calls: int) -> tuple[float, float, float, int]:
  """(kernel µs per call, span µs per call, largest gap µs, kernels) of `calls` back-to-back
  calls in a profiler trace."""
  def back_to_back():
    out = None
    for _ in range(calls):
      out = prepared.call(0)
    prepared.wait(out)
  events = sorted(kernels.device_events(kernels.record_trace(back_to_back), jax.default_backend()))
  if not events:
    raise RuntimeError("the trace holds no device event")
  busy = sum(dur for _, dur, _ in events)
  span = events[-1][0] + events[-1][1] - events[0][0]
  gaps = [b[0] - (a[0] + a[1]) for a, b in zip(events, events[1:])]
  return busy / calls, span / calls, max(gaps, default=0.0), len(events)


def _mean_inside(samples, start: float, end: float) -> tuple[list[float], int] | None:
  """([W, MHz, °C] averaged over the samples in [start, end], their count), None if none."""
  inside = [s[1:] for s in samples if start <= s[0] <= end]
  if not inside:
    return None
  return [sum(column) / len(inside) for column in zip(*inside)], len(inside)


def _print_phase(name: str, start: float, stamps, traced, samples, flops: float,
                 interval: float, trace_calls: int) -> None:
  """A phase's line, its parts' lines (interval > 0) and its trace's line (trace_calls > 0)."""
  elapsed, calls = stamps[-1][0] - stamps[0][0], stamps[-1][1]
  parts = _parts(stamps, interval) if interval else []
  rows = [("all", 0.0, elapsed, elapsed / calls)]
  if len(parts) > 1:
    rows += [(f"{lo:4.1f}-{hi:4.1f}", lo, hi, per_call) for lo, hi, per_call in parts]
  for label, lo, hi, per_call in rows:
    # the first 0.2 s of samples may still show the previous phase's load
    means = _mean_inside(samples, start + max(lo, 0.2), start + hi)
    line = f"{name:12s} {label:>11s} {per_call * 1e3:8.3f} {flops / per_call / 1e12:8.1f}"
    if means is None:
      print(line + "  (no smi samples)")
      continue
    (watts, mhz, celsius), count = means
    joules = watts * per_call
    print(f"{line} {watts:6.1f} {mhz:6.0f} {celsius:5.1f} {joules:7.3f} "
          f"{flops / joules / 1e12:8.3f} {count}" + (f" ({calls} calls)" if label == "all" else ""))
  if traced:
    busy, span, largest_gap, events = traced
    print(f"{name:12s} trace of {trace_calls} calls ({events} kernels): kernels "
          f"{busy / 1e3:.3f} ms per call, first start to last end {span / 1e3:.3f} ms per call "
          f"(idle {100 * (1 - busy / span):.2f}%), largest gap {largest_gap:.1f} us")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--heads", type=int, default=128, help="head dim H")
  p.add_argument("--seqlen", type=int, default=16384)
  p.add_argument("--causal", action="store_true")
  p.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
  p.add_argument("--impl", default="v3,cudnn,v3,cudnn",
                 help="comma-separated bench implementations, run in this order (repeats allowed)")
  p.add_argument("--warm-s", type=float, default=1.0, help="untimed loop before each phase")
  p.add_argument("--interval", type=float, default=0.0,
                 help="seconds per part of the phase to report on its own (0: the phase only)")
  p.add_argument("--trace-calls", type=int, default=0,
                 help="back-to-back calls traced after each phase (0: no trace)")
  p.add_argument("--calls-per-wait", type=int, default=8,
                 help="calls between two waits of the loop (its time stamps)")
  p.add_argument("--pad-bytes", type=int, default=0,
                 help="a live buffer of this many bytes allocated before the inputs: moves every "
                      "buffer after it (where the kernels' operands lie in memory)")
  p.add_argument("--log", default="/tmp/power_probe_smi.csv")
  a = p.parse_args()
  for name in ("seconds", "warm_s", "interval", "trace_calls", "pad_bytes"):
    if getattr(a, name) < 0:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
  if a.calls_per_wait < 1:
    raise ValueError(f"--calls-per-wait must be >= 1, got {a.calls_per_wait}")
  num_heads = 2048 // a.heads
  case = Case(mode=a.mode, batch=16384 // a.seqlen, q_len=a.seqlen, kv_len=a.seqlen,
              num_heads=num_heads, num_kv_heads=num_heads, head_dim=a.heads, causal=a.causal,
              dtype="bfloat16")
  flops = case.flops()
  pad = jax.numpy.zeros(a.pad_bytes, jax.numpy.uint8)  # allocated before the inputs, kept live
  inputs = make_set(case, jax.random.key(0))
  names = a.impl.split(",")
  by_name = {peer.name: peer for peer in all_peers(jax.default_backend())[0]}
  missing = [n for n in names if n not in by_name]
  if missing:
    raise ValueError(f"--impl: {missing} not available here (available: {sorted(by_name)})")
  prepared = {name: prepare(by_name[name], case, [inputs], inputs) for name in set(names)}
  smi = subprocess.Popen(["nvidia-smi",
                          "--query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu",
                          "--format=csv,noheader", "-lms", "100"],
                         stdout=open(a.log, "w"), stderr=subprocess.DEVNULL)
  try:
    phases = []
    for name in names:
      _loop(prepared[name], a.warm_s, a.calls_per_wait)  # reach the power cap
      start, stamps = _loop(prepared[name], a.seconds, a.calls_per_wait)
      traced = _trace_gaps(prepared[name], a.trace_calls) if a.trace_calls else None
      phases.append((name, start, stamps, traced))
  finally:
    time.sleep(0.3)
    smi.terminate()
    smi.wait()
  del pad
  samples = _samples(a.log)
  print(f"{a.mode} {case.label}; {len(samples)} smi samples")
  print(f"{'impl':12s} {'part s':>11s} {'ms/call':>8s} {'TFLOP/s':>8s} {'W':>6s} {'MHz':>6s} "
        f"{'C':>5s} {'J/call':>7s} {'TFLOP/J':>8s} samples")
  for phase in phases:
    _print_phase(*phase, samples, flops, a.interval, a.trace_calls)


if __name__ == "__main__":
  main()
