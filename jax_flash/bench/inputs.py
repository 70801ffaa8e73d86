"""Random inputs for a case: the timed sets (rotated when they would fit in L2) and the check set."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_flash.bench.configs import Case

# H200 L2 is 60 MB (BENCHMARK.md): inputs smaller than this would be timed out of cache.
L2_BYTES = 60 * 2**20
MAX_SETS = 16


def rotation_count(case: Case) -> int:
  """How many distinct input sets the timing loop cycles through: enough that consecutive calls
  of one set are two L2 capacities apart, one when a single set already exceeds L2."""
  per_set = case.input_bytes()
  if per_set >= L2_BYTES:
    return 1
  return min(MAX_SETS, math.ceil(2 * L2_BYTES / per_set))


def _normal(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def make_set(case: Case, key) -> tuple:
  """(q, k, v) or, in fwdbwd mode, (q, k, v, dout): standard normal, never zeros."""
  dtype = jnp.dtype(case.dtype)
  q_shape = (case.batch, case.q_len, case.num_heads, case.head_dim)
  kv_shape = (case.batch, case.kv_len, case.num_kv_heads, case.head_dim)
  keys = jax.random.split(key, 4)
  arrays = [_normal(keys[0], q_shape, dtype), _normal(keys[1], kv_shape, dtype),
            _normal(keys[2], kv_shape, dtype)]
  if case.mode == "fwdbwd":
    arrays.append(_normal(keys[3], q_shape, dtype))
  return tuple(jax.block_until_ready(arrays))


def make_sets(case: Case, seed: int) -> list[tuple]:
  keys = jax.random.split(jax.random.key(seed), rotation_count(case))
  return [make_set(case, key) for key in keys]


def with_rows_of_dout(inputs: tuple, rows: tuple[int, int]) -> tuple:
  """The check set of fwdbwd mode: dout zero outside query rows [start, stop).

  A row with dout = 0 adds nothing to dq, dk or dv (its D = rowsum(dout * out) is 0 too), so the
  gradients of this set are exactly those of the checked rows: the float64 reference needs only
  those rows (and all keys), yet dk and dv are checked for every key."""
  q, k, v, dout = inputs
  start, stop = rows
  keep = (jnp.arange(q.shape[1]) >= start) & (jnp.arange(q.shape[1]) < stop)
  masked = jnp.where(keep[None, :, None, None], dout, jnp.zeros((), dout.dtype))
  return q, k, v, jax.block_until_ready(masked)
