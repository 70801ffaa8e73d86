"""The v2 schedule: FlashAttention-2 on sm_80 tensor cores (mma.sync m16n8k16), cuda/v2.cu.

Forward: one CTA per (query block, head, batch); each warp owns whole query rows, so the online
softmax stays in registers and the output is normalized once at the end. Backward
(cuda/backward.cu, shared with v1): D = rowsum(dout * out), then one CTA per key block
accumulates dK, dV in registers over every query block and adds dQ into an fp32 workspace with
atomics, converted to dq by a last kernel.

Envelope: bfloat16 / float16, head dims up to 256 (padded to a multiple of 8), causal, sliding
window, GQA / MQA, sequence lengths, softcap, bias and mask tensors. Compute capability 9.0:
the instructions are sm_80's, but the backward's tiles take up to 171 KB of shared memory, more
than an A100 gives a block.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._config import AttentionConfig, AttentionShape
from jax_flash.schedules.base import HOPPER, Schedule, register

# Grid dimensions y and z and the kernels' int row indices.
_MAX_GRID_YZ = 65535
_MAX_LENGTH = (1 << 29) - 1


def envelope(shape: AttentionShape, config: AttentionConfig) -> str | None:
  """Limits the v1 / v2 kernels add to the Schedule fields."""
  del config
  if max(shape.q_len, shape.kv_len) > _MAX_LENGTH:
    return f"sequence lengths must be at most {_MAX_LENGTH}"
  if shape.batch > _MAX_GRID_YZ or shape.num_heads > _MAX_GRID_YZ:
    return f"batch and head counts must be at most {_MAX_GRID_YZ}"
  return None


def _head_dim_capacity(head_dim: int) -> int:
  """The kernel instantiation a head dim runs in (v1v2_head_dim_capacity in cuda/v1v2.h)."""
  return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def backward_workspaces(shape: AttentionShape, dtype):
  """dq_accum f32: per (batch, head), T rounded up to a multiple of 128 query rows x the
  head-dim capacity, in the kernels' fragment order (backward_dq_accum_elements in
  cuda/v1v2.h); and dsum f32 [B, N, T] (D = rowsum(dout * out))."""
  del dtype
  b, t, n, h = shape.batch, shape.q_len, shape.num_heads, shape.head_dim
  rows = -(-t // 128) * 128
  return (jax.ShapeDtypeStruct((b, n, rows, _head_dim_capacity(h)), jnp.float32),
          jax.ShapeDtypeStruct((b, n, t), jnp.float32))


V2 = register(Schedule(
    name="v2",
    description="FlashAttention-2 on sm_80 tensor cores: sliced-Q warps, deferred normalization",
    platform="gpu",
    forward_target="jax_flash_v2_fwd",
    backward_target="jax_flash_v2_bwd",
    dtypes=frozenset({"bfloat16", "float16"}),
    max_head_dim=256,
    head_dim_multiple=8,
    compute_capabilities=HOPPER,
    backward_workspaces=backward_workspaces,
    extra_check=envelope,
))
