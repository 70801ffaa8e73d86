"""python -m jax_flash.bench: the command line, the run, and where the outputs go."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import json
import os
import platform
import sys
import time

import jax
import numpy as np

import jax_flash
from jax_flash.bench import ceilings, configs, peers, report
from jax_flash.bench.runner import RunOptions, run_case
from jax_flash.bench.timing import TimingOptions


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x)


def _bools(text: str) -> tuple[bool, ...]:
  if text == "both":
    return (False, True)
  return tuple(bool(int(x)) for x in text.split(",") if x)


def _names(text: str) -> list[str]:
  return [x for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m jax_flash.bench",
      description="Attention benchmark per ../shared/BENCHMARK.md: jax_flash schedules and peers "
                  "in one process, kernels named from a profiler trace, outputs checked against "
                  "float64.")
  p.add_argument("--mode", type=_names, default=["fwd", "fwdbwd"],
                 help="comma list of fwd, fwdbwd, decode (default fwd,fwdbwd)")
  p.add_argument("--heads", type=_ints, help="head dims H (GPU default 64,128,256; CPU 64)")
  p.add_argument("--seqlens", type=_ints, help="T = S (GPU default 1024,4096,16384; CPU 2048)")
  p.add_argument("--causal", type=_bools, help="0, 1, 0,1 or both (default both)")
  p.add_argument("--tokens", type=int, help="B*T (GPU default 16384; CPU 2048)")
  p.add_argument("--width", type=int, help="N*H (GPU default 2048; CPU 512)")
  p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                 help="GPU default bfloat16; CPU float32")
  p.add_argument("--impl", type=_names,
                 help="comma list of implementations (default: all available): schedule names "
                      "(cpu, v1, v2, v3, decode), auto, flash_decode, xla, cudnn, torch_flash, "
                      "torch_cudnn")
  p.add_argument("--quick", action="store_true",
                 help="small and fast: on the CPU the issue's CPU bar forward plus a tiny "
                      "forward+backward (< 1 min); on the GPU H=128, T=4096 only")
  p.add_argument("--out", default="bench_out", help="output folder (default bench_out/)")
  p.add_argument("--repeats", type=int, help="timed repeats (GPU default 5, CPU 3)")
  p.add_argument("--min-repeat-s", type=float, help="seconds each repeat lasts at least")
  p.add_argument("--settle-s", type=float,
                 help="seconds of untimed calls of the same implementation before each repeat "
                      "(GPU default 0.2: its clocks then follow its own power, not the previous "
                      "implementation's; 0 off)")
  p.add_argument("--max-seconds", type=float, default=0.0,
                 help="stop starting new work after this many seconds (0: no limit); the "
                      "outputs still get written")
  p.add_argument("--check-rows", type=int, default=256,
                 help="query rows of the float64 check slice (default 256)")
  p.add_argument("--xla-max-seqlen", type=int,
                 help="skip the unfused XLA peer above this T (GPU default 8192; 0: never skip)")
  p.add_argument("--no-torch", action="store_true", help="leave the PyTorch peers out")
  p.add_argument("--no-ceilings", action="store_true", help="skip the matmul / copy ceilings")
  p.add_argument("--stall-dump-s", type=float, default=120.0,
                 help="while one case runs longer than this many seconds, print every thread's "
                      "Python stack to stderr, again each time as much more passes (the run goes "
                      "on; default 120; 0 off): a stalled run then shows where it waits")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--from-json", metavar="PATH",
                 help="measure nothing: re-render the table and the PNG of an earlier run's JSON "
                      "into --out (e.g. for a GPU run made where matplotlib is missing)")
  args = p.parse_args(argv)
  unknown = [m for m in args.mode if m not in configs.MODES]
  if unknown:
    p.error(f"--mode: {unknown} not among {configs.MODES}")
  if args.check_rows < 1:
    p.error(f"--check-rows must be >= 1; got {args.check_rows}")
  if args.stall_dump_s < 0:
    p.error(f"--stall-dump-s must be >= 0; got {args.stall_dump_s}")
  return args


@contextlib.contextmanager
def stall_dump(seconds: float):
  """Prints every thread's Python stack to stderr each `seconds` while the body runs (0: off).

  From faulthandler's own thread, so it prints while the main thread is blocked in a device wait
  or a lock, which is where a benchmark stalls (an idle GPU with no output, as one run did)."""
  if seconds <= 0:
    yield
    return
  stream = sys.stderr
  try:
    stream.fileno()
  except (AttributeError, OSError, ValueError):  # no file descriptor (e.g. a notebook's stderr)
    stream = sys.__stderr__
  if stream is None:
    yield
    return
  faulthandler.dump_traceback_later(seconds, repeat=True, file=stream)
  try:
    yield
  finally:
    faulthandler.cancel_dump_traceback_later()


def build_cases(args: argparse.Namespace, backend: str) -> list[configs.Case]:
  grid = dict(configs.GPU_GRID if backend == "gpu" else configs.CPU_GRID)
  given = {name: getattr(args, name) for name in ("heads", "seqlens", "tokens", "width")
           if getattr(args, name) is not None}
  if args.quick and backend != "gpu" and not given:
    return [c for c in configs.quick_cases() if c.mode in args.mode]
  if args.quick and backend == "gpu":
    grid.update(heads=(128,), seqlens=(4096,))
  grid.update(given)
  grid.update({k: getattr(args, k) for k in ("causal", "dtype") if getattr(args, k) is not None})
  cases = []
  for mode in args.mode:
    if mode == "decode":
      decode = configs.GPU_DECODE_GRID if backend == "gpu" else configs.CPU_DECODE_GRID
      cases += configs.decode_grid(decode[:1] if args.quick else decode, grid["dtype"])
    else:
      cases += configs.attention_grid(mode, **grid)
  return cases


def timing_options(args: argparse.Namespace, backend: str) -> TimingOptions:
  if backend == "gpu":
    # prepare() and the kernel trace have already run each call three times: one warm-up is
    # enough. A repeat's time includes 0.3-0.4 ms of host latency around its loop (from the
    # timer's start to the first kernel and from the last kernel to the wait's return; JAX's, the
    # same for v3 and cuDNN on the H200, docs/perf-notes.md session 37): 0.2 s repeats hold that
    # to ~0.2% of the time, 50 ms ones (--quick) to 0.6-0.8%.
    options = TimingOptions(repeats=3 if args.quick else 5,
                            min_repeat_s=0.05 if args.quick else 0.2, warmup=1,
                            settle_s=0.0 if args.quick else 0.2)
  else:  # each CPU call takes milliseconds to seconds: few calls, each waited for
    options = TimingOptions(repeats=3, min_repeat_s=0.05 if args.quick else 0.3, warmup=1,
                            wait_each_call=True)
  overrides = {"repeats": args.repeats, "min_repeat_s": args.min_repeat_s,
               "settle_s": args.settle_s}
  return dataclasses.replace(options, **{k: v for k, v in overrides.items() if v is not None})


def _versions() -> dict:
  import jaxlib  # pylint: disable=import-outside-toplevel
  torch = sys.modules.get("torch")
  return {"jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", "?"),
          "jax_flash": jax_flash.__version__, "numpy": np.__version__,
          "torch": getattr(torch, "__version__", None), "python": platform.python_version()}


def _meta(args, backend: str, timing: TimingOptions) -> dict:
  device = jax.devices()[0]
  return {"backend": backend, "device": getattr(device, "device_kind", str(device)),
          "device_count": jax.device_count(), "host_cpus": os.cpu_count(),
          "platform": platform.platform(), **_versions(),
          "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "argv": sys.argv, "args": vars(args), "repeats": timing.repeats,
          "timing": dataclasses.asdict(timing),
          "schedules": [s._asdict() for s in jax_flash.schedules()]}


def cpu_bar_verdict(cases: list[dict]) -> dict | None:
  """The issue's CPU bar: is jax_flash's CPU kernel no slower than XLA's attention there?"""
  bar = configs.CPU_BAR.to_json()
  for case in cases:
    if case["case"] != bar:
      continue
    rows = {r["impl"]: r for r in case["rows"]}
    cpu, xla = rows.get("cpu"), rows.get("xla")
    if not (cpu and xla and cpu["status"] == "ok" and xla["status"] == "ok"):
      return {"text": "CPU bar: not measured (the cpu schedule or the xla peer did not run)"}
    no_slower = cpu["seconds"] <= xla["seconds"]
    speedup = xla["seconds"] / cpu["seconds"]
    text = (f"CPU bar ({configs.CPU_BAR.label}, forward): jax_flash cpu "
            f"{1e3 * cpu['seconds']:.2f} ms vs XLA {1e3 * xla['seconds']:.2f} ms (median): "
            f"{speedup:.2f}x XLA's speed -> {'no slower' if no_slower else 'SLOWER'} than XLA"
            " (run-to-run spread on a shared host can be 5% or more)")
    return {"text": text, "cpu_seconds": cpu["seconds"], "xla_seconds": xla["seconds"],
            "speedup": speedup, "no_slower": no_slower}
  return None


def rerender(path: str, out: str) -> int:
  with open(path) as f:
    payload = json.load(f)
  os.makedirs(out, exist_ok=True)
  _write_outputs(payload, out, payload["meta"]["backend"], final=True)
  print(report.render(payload))
  return 0


def _write_outputs(payload: dict, out: str, backend: str, final: bool) -> None:
  report.write_json(os.path.join(out, f"bench_{backend}.json"), payload)
  if not final:
    return
  with open(os.path.join(out, f"bench_{backend}.txt"), "w") as f:
    f.write(report.render(payload) + "\n")
  try:
    report.plot(os.path.join(out, f"bench_{backend}.png"), payload)
  except Exception as e:  # pylint: disable=broad-except  (the numbers matter more than the plot)
    payload["notes"].append(f"plot failed: {type(e).__name__}: {e}")
    report.write_json(os.path.join(out, f"bench_{backend}.json"), payload)


def main(argv=None) -> int:
  """Runs the benchmark; exit status 1 when any timed output failed its float64 check."""
  args = parse_args(argv)
  if args.from_json:
    return rerender(args.from_json, args.out)
  started = time.monotonic()
  backend = jax.default_backend()
  cases = build_cases(args, backend)
  available, notes = peers.all_peers(backend, include_torch=not args.no_torch)
  chosen, more_notes = peers.select(available, args.impl)
  timing = timing_options(args, backend)
  options = RunOptions(
      backend=backend, timing=timing, check_rows=args.check_rows,
      xla_max_seqlen=(args.xla_max_seqlen if args.xla_max_seqlen is not None
                      else (8192 if backend == "gpu" else 0)),
      seed=args.seed,
      deadline=started + args.max_seconds if args.max_seconds > 0 else float("inf"))
  os.makedirs(args.out, exist_ok=True)
  payload = {"meta": _meta(args, backend, timing), "notes": notes + more_notes,
             "ceilings": {}, "cases": []}
  print(f"jax_flash bench: {len(cases)} case(s) on {payload['meta']['device']}; "
        f"implementations: {', '.join(p.name for p in chosen)}", flush=True)
  if not args.no_ceilings:
    try:
      payload["ceilings"] = ceilings.measure(backend, args.quick, timing)
    except Exception as e:  # pylint: disable=broad-except
      payload["ceilings"] = {"error": f"{type(e).__name__}: {e}"}
    print(report.ceilings_text(payload["ceilings"]), flush=True)
  for case in cases:
    if time.monotonic() > options.deadline:
      payload["notes"].append(f"not run (time budget --max-seconds): {case.mode} {case.label}")
      continue
    with stall_dump(args.stall_dump_s):
      result = run_case(case, [p for p in chosen if case.mode in p.modes], options)
    payload["cases"].append(result)
    print(report.case_details(result) + f"\n   ({result['seconds']:.1f} s)", flush=True)
    _write_outputs(payload, args.out, backend, final=False)
  payload["cpu_bar"] = cpu_bar_verdict(payload["cases"])
  payload["meta"]["seconds"] = time.monotonic() - started
  _write_outputs(payload, args.out, backend, final=True)
  print("\n" + report.render(payload))
  print(f"\nwrote {args.out}/bench_{backend}.json, .txt, .png in "
        f"{payload['meta']['seconds']:.0f} s", flush=True)
  failed = [f"{c['mode']} {c['label']} {r['impl']}" for c in payload["cases"] for r in c["rows"]
            if r["status"] == "ok" and not r["check"]["passed"]]
  if failed:
    print("FLOAT64 CHECK FAILED: " + "; ".join(failed), flush=True)
  return 1 if failed else 0
