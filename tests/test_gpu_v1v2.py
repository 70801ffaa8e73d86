"""GPU-only checks of the v1 / v2 schedules beyond the shared base (tests/test_attention.py):
long sequences in bf16 with GQA, causal masking and sequence lengths, forward and gradients, and
the workspaces each schedule declares. Skipped where no GPU is present or the CUDA targets were
not built; the kernels themselves are also checked without Python by tests/gpu/harness_v1v2.cu.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash._config import AttentionShape
from jax_flash.schedules import v1, v2
from attention_cases import (GRAD_REL, OUT_ATOL, Case, as_f64, make_inputs, reference_backward,
                             reference_forward, relative_l2)


def _available(name: str) -> str | None:
  status = {s.name: s for s in jax_flash.schedules()}.get(name)
  if status is None:
    return f"{name} is not registered"
  return None if status.available else status.reason


LONG = Case(b=2, t=1031, s=1029, n=4, k=2, h=128, dtype="bfloat16", is_causal=True, seqlens=True)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("schedule", ["v1", "v2"])
def test_long_causal_gqa_seqlens(schedule, rng):
  if reason := _available(schedule):
    pytest.skip(reason)
  x = make_inputs(LONG, rng)
  dout = jnp.asarray(rng.standard_normal(x.q.shape), jnp.float32).astype(LONG.dtype)
  arrays, statics = x.arrays(), x.statics(LONG)

  def loss(q, k, v):
    out = jax_flash.flash_attention(q, k, v, schedule=schedule, **arrays, **statics)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
      x.q, x.k, x.v)
  want_out, _ = reference_forward(LONG, x)
  err = np.max(np.abs(as_f64(out) - want_out))
  assert err <= OUT_ATOL[LONG.dtype], f"max abs error {err:.3g}"
  for name, got, want in zip(("dq", "dk", "dv"), grads, reference_backward(LONG, x, dout)[:3]):
    rel = relative_l2(got, want)
    assert rel <= GRAD_REL[LONG.dtype], f"{name} relative L2 error {rel:.3g}"


def test_workspace_shapes_follow_the_kernels():
  """dq_accum covers the query rows rounded up to 128 (whole blocks of either backward query
  block, 64 or 128 rows) x the head-dim capacity (backward_dq_accum_elements, cuda/v1v2.h)."""
  shape = AttentionShape(batch=2, q_len=65, kv_len=7, num_heads=3, num_kv_heads=1, head_dim=72)
  dq_accum, dsum = v2.backward_workspaces(shape, jnp.bfloat16)
  assert dq_accum.shape == (2, 3, 128, 128) and dq_accum.dtype == jnp.float32
  assert dsum.shape == (2, 3, 65)
  (o_accum,) = v1.forward_workspaces(shape, jnp.bfloat16)
  assert o_accum.shape == (2, 3, 65, 72)
  longer = AttentionShape(batch=1, q_len=130, kv_len=7, num_heads=1, num_kv_heads=1, head_dim=64)
  assert v2.backward_workspaces(longer, jnp.bfloat16)[0].shape == (1, 1, 256, 64)
