"""The machine's ceilings, measured in the same run (BENCHMARK.md): a large matmul and a large copy.

GPU: a bf16 8192³ matmul and a read+write pass over 2 GiB. The CPU versions are smaller (an
8192³ f32 matmul takes tens of seconds on a laptop-class host); the sizes are in the output.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash.bench.timing import TimingOptions, time_calls


def _sizes(backend: str, quick: bool) -> tuple[int, str, int]:
  """(matmul n, matmul dtype, copy elements of float32)."""
  if backend == "gpu":
    return 8192, "bfloat16", 2**29
  return (1024, "float32", 2**22) if quick else (2048, "float32", 2**26)


def measure(backend: str, quick: bool, options: TimingOptions) -> dict:
  n, dtype, elements = _sizes(backend, quick)
  keys = jax.random.split(jax.random.key(1), 3)
  a = jax.random.normal(keys[0], (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(keys[1], (n, n), jnp.float32).astype(dtype)
  matmul = jax.jit(jnp.matmul)
  t_matmul = time_calls(lambda i: matmul(a, b), jax.block_until_ready, options)
  x = jax.random.normal(keys[2], (elements,), jnp.float32)
  copy = jax.jit(lambda y: y + 1.0)  # one read and one write of every element
  t_copy = time_calls(lambda i: copy(x), jax.block_until_ready, options)
  copy_bytes = 2 * x.size * x.dtype.itemsize
  return {
      "matmul": {"n": n, "dtype": dtype, "flops": 2.0 * n**3, "timing": t_matmul.to_json(),
                 "tflops": 2.0 * n**3 / t_matmul.median_s / 1e12},
      "copy": {"bytes_moved": copy_bytes, "what": "y = x + 1 over float32 (read + write)",
               "timing": t_copy.to_json(), "tbps": copy_bytes / t_copy.median_s / 1e12},
  }
