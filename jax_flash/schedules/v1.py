"""The v1 schedule: FlashAttention-1 on sm_80 tensor cores (mma.sync m16n8k16), cuda/v1.cu.

Forward: one CTA per (batch, head) walks the whole attention matrix, key blocks outermost and
query steps of 16 rows inside; the four warps split each key block (sliced-K) and combine row
maxima, sums and partial outputs through shared memory behind barriers. The output is merged,
normalized, into an fp32 workspace after every key block (FlashAttention-1's running output).
Backward: the v2 kernels with FlashAttention-1's order, one CTA per (batch, kv head) over all
key blocks in turn, adding dQ without atomics (cuda/backward.cu).

Same envelope as v2 (see v2.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._config import AttentionShape
from jax_flash.schedules.base import HOPPER, Schedule, register
from jax_flash.schedules.v2 import backward_workspaces, envelope


def forward_workspaces(shape: AttentionShape, dtype):
  """o_accum f32 [B, N, T, H]: the running normalized output between key blocks."""
  del dtype
  return (jax.ShapeDtypeStruct(
      (shape.batch, shape.num_heads, shape.q_len, shape.head_dim), jnp.float32),)


V1 = register(Schedule(
    name="v1",
    description="FlashAttention-1 on sm_80 tensor cores: one CTA per head, sliced-K warps",
    platform="gpu",
    forward_target="jax_flash_v1_fwd",
    backward_target="jax_flash_v1_bwd",
    dtypes=frozenset({"bfloat16", "float16"}),
    max_head_dim=256,
    head_dim_multiple=8,
    compute_capabilities=HOPPER,
    forward_workspaces=forward_workspaces,
    backward_workspaces=backward_workspaces,
    backward_determinism="always",  # one CTA per kv head walks the key blocks in order
    extra_check=envelope,
))
