"""Timing per BENCHMARK.md: a host loop of asynchronous calls closed by one wait.

On the GPU, consecutive calls queue on one stream, so waiting for the last call waits for all and
the loop measures device time, not Python dispatch (checked on the H200 against CUDA events, 1%).
On the CPU the runtime may overlap independent calls, so every call is waited for (each takes
milliseconds there: the wait costs nothing measurable).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class TimingOptions:
  repeats: int = 5            # timed repeats; the median and the best are reported
  min_repeat_s: float = 0.05  # each repeat loops until about this long
  max_iters: int = 1000
  warmup: int = 2
  wait_each_call: bool = False
  # Untimed calls of the same target right before each timed repeat, lasting about this long:
  # the H200 runs at its 700 W power cap in these loops, and its clocks follow the power of the
  # last few hundred milliseconds; without this a repeat is clocked by the previous target's
  # power (a low-power peer before it lends it headroom), not by its own.
  settle_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Timing:
  median_s: float             # per call
  best_s: float
  samples_s: tuple            # per call, one per repeat
  iters: int                  # calls per repeat

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


Call = Callable[[int], Any]
Wait = Callable[[Any], None]


def _per_call_seconds(call: Call, wait: Wait, iters: int, wait_each_call: bool) -> float:
  start = time.perf_counter()
  out = None
  for i in range(iters):
    out = call(i)
    if wait_each_call:
      wait(out)
  wait(out)
  return (time.perf_counter() - start) / iters


def warm_up(call: Call, wait: Wait, options: TimingOptions) -> int:
  """Runs the warm-up calls; returns the calls per repeat that last about min_repeat_s."""
  for i in range(options.warmup):
    wait(call(i))
  single = max(_per_call_seconds(call, wait, 1, True), 1e-7)
  return max(1, min(options.max_iters, math.ceil(options.min_repeat_s / single)))


def time_interleaved(targets: dict[str, tuple[Call, Wait, int]],
                     options: TimingOptions) -> dict[str, Timing]:
  """Seconds per call of each target (call, wait, iters from warm_up). Repeat r of every target
  runs before repeat r + 1 of any, so a drift of the device (clocks, power, temperature) during
  the case reaches every implementation alike instead of whichever ran last; each repeat is
  preceded by options.settle_s of untimed calls of its own target."""
  samples = {name: [] for name in targets}
  for _ in range(options.repeats):
    for name, (call, wait, iters) in targets.items():
      if options.settle_s > 0 and options.min_repeat_s > 0:
        settle_iters = math.ceil(iters * options.settle_s / options.min_repeat_s)
        _per_call_seconds(call, wait, settle_iters, options.wait_each_call)
      samples[name].append(_per_call_seconds(call, wait, iters, options.wait_each_call))
  return {name: Timing(statistics.median(s), min(s), tuple(s), targets[name][2])
          for name, s in samples.items()}


def time_calls(call: Call, wait: Wait, options: TimingOptions) -> Timing:
  """Seconds per call of `call(i)` (i cycles the input sets inside `call`)."""
  iters = warm_up(call, wait, options)
  return time_interleaved({"": (call, wait, iters)}, options)[""]
