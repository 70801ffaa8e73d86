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


@dataclasses.dataclass(frozen=True)
class Timing:
  median_s: float             # per call
  best_s: float
  samples_s: tuple            # per call, one per repeat
  iters: int                  # calls per repeat

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def time_calls(call: Callable[[int], Any], wait: Callable[[Any], None],
               options: TimingOptions) -> Timing:
  """Seconds per call of `call(i)` (i cycles the input sets inside `call`)."""
  for i in range(options.warmup):
    wait(call(i))
  start = time.perf_counter()
  wait(call(0))
  single = max(time.perf_counter() - start, 1e-7)
  iters = max(1, min(options.max_iters, math.ceil(options.min_repeat_s / single)))
  samples = []
  for _ in range(options.repeats):
    start = time.perf_counter()
    out = None
    for i in range(iters):
      out = call(i)
      if options.wait_each_call:
        wait(out)
    wait(out)
    samples.append((time.perf_counter() - start) / iters)
  return Timing(statistics.median(samples), min(samples), tuple(samples), iters)
