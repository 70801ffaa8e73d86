"""Which kernel executed: read from a profiler trace, never from which Python function was called.

All implementations of one case run once each inside one `jax.profiler.trace(...,
create_perfetto_trace=True)`, each inside its own host `TraceAnnotation`, separated by idle gaps.
The perfetto JSON is parsed and every device event is attributed to the annotation window that
holds it:
  GPU: the kernels (and copies) on the device's stream lines ("/device:GPU:n", "Stream #...").
       CUPTI records every kernel of the process, so torch's kernels land there as well;
       torch.profiler is the fallback for a torch implementation with no event in the window.
  CPU: the XLA thunks (events with an "hlo_op" argument, on whichever host thread ran them);
       their names are HLO instruction names, resolved through the compiled HLO
       (`jit(f).lower(...).compile().as_text()`) to the custom-call target (e.g.
       jax_flash_cpu_fwd) or the fusion kind.
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Callable

import jax

ANNOTATION_PREFIX = "jax_flash_bench="  # no ":" : the trace export keeps only what follows one
GAP_S = 0.01          # idle time between implementations in the trace
SLACK_US = 4000.0     # a device event this close to a window still belongs to it (clock offsets)
RUNS_PER_IMPL = 2     # calls per implementation in the trace: steadier shares on a busy host

# Timeline lines xprof derives from the real device lines; they repeat the kernels' time.
_DERIVED_LINES = {"Steps", "TensorFlow Name Scope", "TensorFlow Ops", "XLA Modules", "XLA Ops",
                  "Async XLA Ops", "Launch Stats", "Source code", "Framework Name Scope",
                  "Framework Ops"}


@dataclasses.dataclass
class Kernel:
  name: str          # as the trace (and HLO, on CPU) names it
  time_us: float     # total over the calls in the trace
  calls: int
  share: float       # of this implementation's device time in the trace


@dataclasses.dataclass
class KernelReport:
  kernels: list[Kernel]   # heaviest first
  source: str             # how the names were read
  error: str = ""

  def dominant(self, coverage: float = 0.95, limit: int = 4) -> list[Kernel]:
    """The heaviest kernels, until they cover `coverage` of the time (at most `limit`)."""
    chosen, covered = [], 0.0
    for kernel in self.kernels[:limit]:
      chosen.append(kernel)
      covered += kernel.share
      if covered >= coverage:
        break
    return chosen

  def signature(self) -> frozenset:
    """The identity of what ran: every kernel name, whatever its share (shares of short kernels
    jitter on a busy host; a stray extra kernel only prevents a merge, never causes one)."""
    return frozenset(k.name for k in self.kernels)

  def lost_events(self, runs: int) -> list[str]:
    """The kernels recorded a number of times that is not a multiple of `runs`, the identical
    calls traced: the profiler lost some of their events, so the trace undercounts their time
    (seen on the H200: an XLA decode fusion recorded in 1 of 2 calls, which put that row's device
    time above the HBM peak; cuDNN's backward in 2 of 3 training steps)."""
    return [k.name for k in self.kernels if k.calls % runs]

  def ms_per_call(self, runs: int) -> float | None:
    """Device time per call of `runs` traced calls; None when the trace lost events."""
    if self.error or self.lost_events(runs):
      return None
    return sum(k.time_us for k in self.kernels) / runs / 1e3

  def summary(self, width: int = 70) -> str:
    if self.error:
      return f"unknown ({self.error})"
    return ", ".join(f"{short_name(k.name, width)} {100 * k.share:.0f}%" for k in self.dominant())

  def to_json(self) -> dict:
    return {"source": self.source, "error": self.error,
            "kernels": [dataclasses.asdict(k) for k in self.kernels]}


def error_report(source: str, error: str) -> KernelReport:
  return KernelReport([], source, error)


# -- names ------------------------------------------------------------------------------------

def short_name(name: str, width: int = 70) -> str:
  """A kernel name fit for a table: demangled, template arguments and parameters dropped."""
  name = demangle(name)
  name = re.sub(r"^void ", "", name)
  depth, kept = 0, []
  for ch in name:  # drop everything inside <...> and (...)
    if ch in "<(":
      depth += 1
    elif ch in ">)" and depth:
      depth -= 1
    elif depth == 0:
      kept.append(ch)
  short = "".join(kept).strip() or name
  return short if len(short) <= width else short[:width - 3] + "..."


_DEMANGLED: dict[str, str] = {}


def demangle(name: str) -> str:
  if not name.startswith("_Z") or shutil.which("c++filt") is None:
    return name
  if name not in _DEMANGLED:
    try:
      result = subprocess.run(["c++filt", name], capture_output=True, text=True, timeout=10)
      _DEMANGLED[name] = result.stdout.strip() or name
    except (OSError, subprocess.SubprocessError):
      _DEMANGLED[name] = name
  return _DEMANGLED[name]


_HLO_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+) = (?:\(.*?\)|\S+) (?P<op>[a-z][a-z0-9_-]*)\((?P<rest>.*)$")


def hlo_instructions(hlo_text: str) -> dict[str, str]:
  """{instruction name: what it is} for a compiled HLO module: the custom-call target of a custom
  call, the fusion kind (and backend fusion kind) of a fusion, else the opcode."""
  described = {}
  for line in hlo_text.splitlines():
    match = _HLO_INSTRUCTION.match(line)
    if not match:
      continue
    op, rest = match["op"], match["rest"]
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    if target:
      described[match["name"]] = f"custom-call {target[1]}"
    elif op == "fusion":
      kind = re.search(r"kind=(\w+)", rest)
      backend_kind = re.search(r'"fusion_config":\{"kind":"([^"]+)"', rest)
      described[match["name"]] = " ".join(
          ["fusion"] + [m[1] for m in (kind, backend_kind) if m])
    else:
      described[match["name"]] = op
  return described


def resolve_cpu_names(report: KernelReport, hlo_text: str) -> KernelReport:
  """Rename CPU thunks after what they are: 'custom-call.2' -> 'jax_flash_cpu_fwd (custom-call.2)'.
  A custom call is named by its target first, so the same target under two modules compares
  equal; other instructions keep their name with the kind appended."""
  described = hlo_instructions(hlo_text)
  merged: dict[str, Kernel] = {}
  for kernel in report.kernels:
    what = described.get(kernel.name, "")
    if what.startswith("custom-call "):
      name = what.split(" ", 1)[1]
    elif what:
      name = f"{kernel.name} [{what}]"
    else:
      name = kernel.name
    if name in merged:
      merged[name].time_us += kernel.time_us
      merged[name].calls += kernel.calls
      merged[name].share += kernel.share
    else:
      merged[name] = dataclasses.replace(kernel, name=name)
  kernels = sorted(merged.values(), key=lambda k: -k.time_us)
  return KernelReport(kernels, report.source + " + compiled HLO", report.error)


# -- the jax profiler trace -------------------------------------------------------------------

def record_trace(body: Callable[[], None]) -> dict:
  """The perfetto trace (parsed JSON) of a jax profiler trace around `body`."""
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0  # every Python call as an event: a bigger, slower trace
  with tempfile.TemporaryDirectory(prefix="jax_flash_bench_trace_") as log_dir:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True, profiler_options=options):
      body()
    return load_perfetto(log_dir)


def trace_kernels(runs: dict[str, Callable[[], None]], backend: str) -> dict[str, KernelReport]:
  """Run each implementation RUNS_PER_IMPL times (each `run` blocks until its work is done)
  inside one profiler trace and return the kernels attributed to each."""
  def run_all():
    for name, run in runs.items():
      time.sleep(GAP_S)
      with jax.profiler.TraceAnnotation(ANNOTATION_PREFIX + name):
        for _ in range(RUNS_PER_IMPL):
          run()
    time.sleep(GAP_S)
  return attribute(record_trace(run_all), list(runs), backend)


def load_perfetto(log_dir: str) -> dict:
  paths = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
  with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
    return json.load(f)


def _names(events: list[dict]) -> tuple[dict, dict]:
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") != "M":
      continue
    if e.get("name") == "process_name":
      processes[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
  return processes, threads


def device_source(backend: str) -> str:
  if backend == "cpu":
    return "jax profiler trace: XLA thunks on the host CPU threads"
  return "jax profiler trace: kernels on the GPU stream lines"


def _is_device_event(backend: str, process: str, thread: str, event: dict) -> bool:
  if backend == "cpu":  # an XLA CPU thunk names its HLO instruction; "end: x" marks its end
    return "hlo_op" in event.get("args", {}) and not event.get("name", "").startswith("end: ")
  return "/device:GPU" in process and thread not in _DERIVED_LINES


def _top_level(events: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
  """Drop events nested inside an earlier event of the same lane (their time is counted once)."""
  kept, end = [], -1.0
  for ts, dur, name in sorted(events):
    if ts >= end:
      kept.append((ts, dur, name))
      end = ts + dur
  return kept


def device_events(trace: dict, backend: str) -> list[tuple[float, float, str]]:
  """(ts_us, dur_us, name) of the device work in the trace."""
  events = trace.get("traceEvents", [])
  processes, threads = _names(events)
  lanes: dict[tuple, list] = {}
  for e in events:
    if e.get("ph") != "X":
      continue
    process, thread = processes.get(e.get("pid"), ""), threads.get((e.get("pid"), e.get("tid")), "")
    if _is_device_event(backend, process, thread, e):
      lanes.setdefault((e.get("pid"), e.get("tid"), thread), []).append(
          (float(e["ts"]), float(e.get("dur", 0.0)), e["name"]))
  if backend != "cpu":  # prefer the stream lines when the trace names them
    streams = {lane: ev for lane, ev in lanes.items() if "stream" in lane[2].lower()}
    lanes = streams or lanes
  return [event for lane in lanes.values() for event in _top_level(lane)]


def annotation_windows(trace: dict, names: list[str]) -> dict[str, tuple[float, float]]:
  windows = {}
  for e in trace.get("traceEvents", []):
    name = e.get("name", "")
    if e.get("ph") == "X" and name.startswith(ANNOTATION_PREFIX):
      impl = name[len(ANNOTATION_PREFIX):]
      if impl in names:
        windows[impl] = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
  return windows


def _window_of(ts: float, dur: float, windows: dict[str, tuple[float, float]]) -> str | None:
  """The implementation whose window holds the event's middle (or lies within SLACK_US of it)."""
  middle = ts + dur / 2
  distance = {impl: max(start - middle, middle - stop, 0.0) for impl, (start, stop) in windows.items()}
  if not distance:
    return None
  impl = min(distance, key=distance.get)
  return impl if distance[impl] <= SLACK_US else None


def attribute(trace: dict, names: list[str], backend: str) -> dict[str, KernelReport]:
  source = device_source(backend)
  windows = annotation_windows(trace, names)
  totals: dict[str, dict[str, list]] = {name: {} for name in names}
  for ts, dur, kernel in device_events(trace, backend):
    impl = _window_of(ts, dur, windows)
    if impl is not None:
      entry = totals[impl].setdefault(kernel, [0.0, 0])
      entry[0] += dur
      entry[1] += 1
  reports = {}
  for name in names:
    if name not in windows:
      reports[name] = error_report(source, "its annotation is missing from the trace")
      continue
    reports[name] = _report(totals[name], source)
  return reports


def _report(per_kernel: dict[str, list], source: str) -> KernelReport:
  total = sum(t for t, _ in per_kernel.values())
  if not per_kernel or total <= 0:
    return error_report(source, "no device event inside its window")
  kernels = [Kernel(name, t, calls, t / total) for name, (t, calls) in per_kernel.items()]
  return KernelReport(sorted(kernels, key=lambda k: -k.time_us), source)


# -- torch ------------------------------------------------------------------------------------

def torch_profiler_kernels(run: Callable[[], None]) -> KernelReport:
  """The CUDA kernels torch.profiler sees while `run` executes (its own synchronize included)."""
  from torch.profiler import ProfilerActivity, profile  # pylint: disable=import-outside-toplevel
  source = "torch.profiler: CUDA kernel events"
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    run()
  per_kernel: dict[str, list] = {}
  for event in prof.events():
    if str(getattr(event, "device_type", "")).endswith("CUDA"):
      entry = per_kernel.setdefault(event.name, [0.0, 0])
      entry[0] += event.time_range.elapsed_us()
      entry[1] += 1
  return _report(per_kernel, source)


# -- the same kernel under two names ----------------------------------------------------------

def same_kernel_groups(reports: dict[str, KernelReport],
                       framework: dict[str, str]) -> dict[str, str]:
  """{alias: representative} for implementations that ran the same kernels as an earlier one of
  the same framework (e.g. schedule 'auto' and the schedule it picked). Order of `reports` decides
  which name represents the group."""
  seen: dict[tuple, str] = {}
  aliases = {}
  for name, report in reports.items():
    signature = report.signature()
    if not signature:
      continue
    key = (framework[name], signature)
    if key in seen:
      aliases[name] = seen[key]
    else:
      seen[key] = name
  return aliases


def cross_framework_matches(reports: dict[str, KernelReport],
                            framework: dict[str, str]) -> dict[str, str]:
  """{name: other} where two frameworks launched the very same kernel set (both are kept and
  timed: the launch path differs, but the table says they share the kernel)."""
  matches = {}
  names = list(reports)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      sig = reports[a].signature()
      if sig and framework[a] != framework[b] and sig == reports[b].signature():
        matches.setdefault(b, a)
  return matches
