"""Shared case vocabulary for the schedule test base: inputs, reference, tolerances."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jax_flash import reference

# Max abs error vs float64 allowed on outputs of magnitude ~1, and relative L2 error on grads.
# bf16 / f16 round the inputs (the reference sees the same rounded values), P before the PV
# product and the output; f32 accumulates in f32.
OUT_ATOL = {"float32": 5e-5, "bfloat16": 2.5e-2, "float16": 4e-3}
GRAD_REL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 6e-3}


@dataclasses.dataclass(frozen=True)
class Case:
  b: int = 2
  t: int = 17
  s: int = 17
  n: int = 4
  k: int = 2
  h: int = 32
  dtype: str = "float32"
  is_causal: bool = False
  window: tuple | None = None
  bias: tuple | None = None        # bias shape pattern, "1" = broadcast dim, e.g. ("1","n","t","s")
  mask: tuple | None = None
  seqlens: bool = False
  softcap: float | None = None
  scale: float | None = None

  def __str__(self):
    parts = [f"B{self.b}T{self.t}S{self.s}N{self.n}K{self.k}H{self.h}", self.dtype]
    for name in ("is_causal", "window", "bias", "mask", "seqlens", "softcap", "scale"):
      value = getattr(self, name)
      if value not in (None, False):
        parts.append(name if value is True else f"{name}={''.join(value) if isinstance(value, tuple) and isinstance(value[0], str) else value}")
    return "-".join(parts)

  def dims(self, pattern):
    full = {"b": self.b, "n": self.n, "t": self.t, "s": self.s, "1": 1}
    return tuple(full[p] for p in pattern)


@dataclasses.dataclass
class Inputs:
  q: jnp.ndarray
  k: jnp.ndarray
  v: jnp.ndarray
  bias: jnp.ndarray | None
  mask: jnp.ndarray | None
  q_lens: jnp.ndarray | None
  kv_lens: jnp.ndarray | None

  def arrays(self) -> dict:
    """The array keyword arguments of flash_attention (traced under jit)."""
    return dict(bias=self.bias, mask=self.mask, query_seq_lengths=self.q_lens,
                key_value_seq_lengths=self.kv_lens)

  @staticmethod
  def statics(case: Case) -> dict:
    """The static keyword arguments of flash_attention (closed over, never traced)."""
    return dict(scale=case.scale, is_causal=case.is_causal, local_window_size=case.window,
                softcap=case.softcap)

  def reference_kwargs(self, case: Case) -> dict:
    left, right = case.window if case.window is not None else (-1, -1)
    return dict(bias=_np(self.bias), mask=_np(self.mask), q_seqlens=_np(self.q_lens),
                kv_seqlens=_np(self.kv_lens),
                scale=case.scale if case.scale is not None else 1 / np.sqrt(case.h),
                softcap=case.softcap or 0.0, is_causal=case.is_causal, window_left=left,
                window_right=right)


def _np(x):
  return None if x is None else np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)


def make_inputs(case: Case, rng) -> Inputs:
  def normal(shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(case.dtype)

  q = normal((case.b, case.t, case.n, case.h))
  k = normal((case.b, case.s, case.k, case.h))
  v = normal((case.b, case.s, case.k, case.h))
  bias = normal(case.dims(case.bias)).astype(jnp.float32) if case.bias else None
  mask = jnp.asarray(rng.random(case.dims(case.mask)) > 0.25) if case.mask else None
  q_lens = kv_lens = None
  if case.seqlens:
    q_lens = jnp.asarray(rng.integers(0, case.t + 1, case.b), jnp.int32)
    kv_lens = jnp.asarray(rng.integers(1, case.s + 1, case.b), jnp.int32)
  return Inputs(q, k, v, bias, mask, q_lens, kv_lens)


def as_f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def reference_forward(case: Case, x: Inputs):
  return reference.attention_forward_f64(as_f64(x.q), as_f64(x.k), as_f64(x.v),
                                         **x.reference_kwargs(case))


def reference_backward(case: Case, x: Inputs, dout):
  return reference.attention_backward_f64(as_f64(x.q), as_f64(x.k), as_f64(x.v), as_f64(dout),
                                          **x.reference_kwargs(case))


def relative_l2(got, want) -> float:
  got, want = as_f64(got), np.asarray(want, np.float64)
  denom = np.linalg.norm(want)
  return float(np.linalg.norm(got - want) / (denom if denom > 0 else 1.0))
