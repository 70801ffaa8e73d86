"""python -m jax_flash.bench: jax_flash's schedules against their peers, per ../shared/BENCHMARK.md.

  configs.py   the cases (the BENCHMARK.md grids, the CPU bar) and their FLOP / byte counts
  inputs.py    random inputs, rotated when they would fit in L2
  peers.py     the implementations compared (jax_flash schedules, XLA, cuDNN, torch SDPA)
  steps.py     one peer on one case: the compiled forward or forward+backward call
  timing.py    the host loop of asynchronous calls closed by one wait
  kernels.py   which kernel executed, from a profiler trace; the same kernel under two names
  accuracy.py  every timed output against the float64 reference
  ceilings.py  matmul and copy ceilings measured in the same run
  runner.py    one case, every peer;  report.py  tables, JSON, PNG;  cli.py  the command line
"""
import os

# PyTorch peers share the GPU with JAX: JAX must not take 75% of its memory up front. This only
# takes effect when no JAX backend has been initialized yet (set it in the environment to be sure).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
