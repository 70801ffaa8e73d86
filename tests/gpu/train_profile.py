"""Where a training step's device time goes, kernel by kernel, with v3 and with cuDNN attention.

examples/train.py's step both ways, side by side, from one jax profiler trace (issue #5).

  python3 tests/gpu/train_profile.py [--steps 3] [train.py's model flags, e.g. --kv-heads 16]

Both steps are built from the same parameters and batch, compiled and warmed first, then each
runs --steps times inside its own annotation of one trace. Prints, per implementation, the
device time per step and the kernels (per step, heaviest first), then the total of XLA's own
fusions (named per program, so not paired by name) and the named kernels (the library's,
cuDNN's, cuBLAS's) whose time differs most between the two.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import tiny_lm  # noqa: E402  (examples/ is not a package)
import train  # noqa: E402

from jax_flash.bench import kernels  # noqa: E402

IMPLEMENTATIONS = {"v3": ("direct", "v3"), "cudnn": ("cudnn", "auto")}


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3, help="steps per implementation traced")
  parser.add_argument("--top", type=int, default=12, help="kernels listed per implementation")
  train.add_shape_arguments(parser)
  # The training-step comparison's shape (docs/perf-notes.md): GQA 16:2, causal, T = 4096.
  parser.set_defaults(batch=4, seq_len=4096, d_model=2048, heads=16, layers=1)
  return parser.parse_args()


def step_runner(config, attention: str, schedule: str, params, tokens):
  """A no-argument call running one training step to completion (compiled and warmed)."""
  step, opt_state = train.make_train_step(train.make_loss(config, attention, schedule), params,
                                          3e-4)
  for _ in range(2):
    jax.block_until_ready(step(params, opt_state, tokens))
  return lambda: jax.block_until_ready(step(params, opt_state, tokens))


def print_report(name: str, report: kernels.KernelReport, steps: int, top: int) -> None:
  if report.error:
    print(f"{name}: {report.error}")
    return
  total = sum(k.time_us for k in report.kernels) / steps
  print(f"\n{name}: {total / 1e3:.3f} ms device time per step ({len(report.kernels)} kernels)")
  for k in report.kernels[:top]:
    print(f"  {k.time_us / steps:9.1f} us {k.calls // steps:3d}x  {kernels.short_name(k.name, 90)}")
  lost = [kernels.short_name(n, 60) for n in report.lost_events(steps)]
  if lost:
    print(f"  INCOMPLETE TRACE: {len(lost)} kernel(s) ran a number of times that is not a "
          f"multiple of the {steps} steps traced (the profiler lost events; their per-step "
          f"times and the step's total undercount): {', '.join(lost[:3])}")


# Kernels whose names mean the same code in both programs (the library's, cuDNN's, cuBLAS's);
# the rest are XLA's own fusions, which XLA names per program (the same name in the two steps can
# be a different fusion), so they are compared as one total only.
_NAMED_KERNEL_PREFIXES = ("jax_flash::", "cudnn", "nvjet", "sm90_xmma", "cutlass")


def _category(name: str) -> str:
  return "named" if name.startswith(_NAMED_KERNEL_PREFIXES) else "xla"


def print_differences(reports: dict[str, kernels.KernelReport], steps: int, top: int) -> None:
  per_step = {impl: {kernels.short_name(k.name, 90): k.time_us / steps for k in r.kernels}
              for impl, r in reports.items()}
  xla_total = {impl: sum(t for n, t in times.items() if _category(n) == "xla")
               for impl, times in per_step.items()}
  print(f"\nXLA's own fusions (names are per program, not paired): v3 {xla_total['v3']:.1f} us, "
        f"cudnn {xla_total['cudnn']:.1f} us per step ({xla_total['v3'] - xla_total['cudnn']:+.1f})")
  names = {n for times in per_step.values() for n in times if _category(n) == "named"}
  delta = {n: per_step["v3"].get(n, 0.0) - per_step["cudnn"].get(n, 0.0) for n in names}
  print("largest differences of the named kernels (v3 - cudnn, us per step):")
  for n in sorted(names, key=lambda n: -abs(delta[n]))[:top]:
    print(f"  {delta[n]:+9.1f}  v3 {per_step['v3'].get(n, 0.0):8.1f}  "
          f"cudnn {per_step['cudnn'].get(n, 0.0):8.1f}  {n}")


def main() -> int:
  args = parse_args()
  config = tiny_lm.ModelConfig(d_model=args.d_model, num_layers=args.layers, seq_len=args.seq_len,
                               num_heads=args.heads, num_kv_heads=args.kv_heads, dtype="bfloat16")
  params = tiny_lm.init_params(config, jax.random.PRNGKey(0))
  tokens = next(train.batches(tiny_lm.load_corpus(), args.batch, args.seq_len,
                              np.random.default_rng(0)))
  runners = {name: step_runner(config, attention, schedule, params, tokens)
             for name, (attention, schedule) in IMPLEMENTATIONS.items()}
  runs = {name: (lambda run=run: [run() for _ in range(args.steps)]) for name, run in
          runners.items()}
  reports = kernels.trace_kernels(runs, jax.default_backend())
  steps = args.steps * kernels.RUNS_PER_IMPL
  for name, report in reports.items():
    print_report(name, report, steps, args.top)
  if not any(r.error for r in reports.values()):
    print_differences(reports, steps, args.top)
  return 0


if __name__ == "__main__":
  sys.exit(main())
