"""The decode schedule: split-KV Flash-Decoding (cuda/decode.cu) for short queries.

Forward: one thread block per (sequence, kv head, split of the key range); the block holds all
query rows that read its kv head (T x N/K, up to 64) in one tile, so every K/V byte is read once,
streams its keys through a cp.async ring, and the last block of each (sequence, kv head) to finish
merges the splits' partial (out, logsumexp) with the logsumexp identity. The split count is picked
on the device side (DecodeAutoSplits): one block per multiprocessor when that keeps 90% of them
busy, else one wave that fills every block slot; at most the workspace's first dimension. It
implements the standard convention (top-left causal, sequence lengths, sliding windows, softcap),
without bias or mask tensors.

Backward: v3's (cuda/v3_bwd_sm90.cu). The forward's out and lse follow the convention, so it
consumes them unchanged.

Envelope: bfloat16 / float16, head dim 64, 128 or 256 (exactly: padding would copy the whole
cache), T * N / K <= 64 query rows per kv head, no bias or mask; compute capability 9.0 (the
backward's shared memory).

This module also owns the workspace layout that jax_flash.flash_decode's own targets use.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_flash._config import AttentionConfig, AttentionShape
from jax_flash.schedules import v3
from jax_flash.schedules.base import HOPPER, Schedule, register

HEAD_DIMS = (64, 128, 256)
MAX_ROWS = 64            # query rows (T * N / K) one block holds for a kv head
MAX_SPLITS = 65535       # grid dimension y
_BLOCK_KEYS = 64         # keys per pipeline stage
_MIN_TILES_PER_SPLIT = 4
_MAX_BLOCKS_PER_SM = 8   # bounds the kernels' occupancy from above
_DEFAULT_SM_COUNT = 132  # H100 / H200, when the device does not say


def kernel_limits(batch: int, q_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  kv_len: int) -> str | None:
  """Why the decode kernels cannot take these sizes (None when they can)."""
  if head_dim not in HEAD_DIMS:
    return f"head dim must be one of {HEAD_DIMS}; got {head_dim}"
  if batch > 65535:
    return f"batch must be at most 65535; got {batch}"
  if kv_len + q_len >= 2**31:
    return "sequence lengths must stay below 2^31"
  return None


def _sm_count() -> int:
  return getattr(jax.devices()[0], "core_count", None) or _DEFAULT_SM_COUNT


def max_splits(batch: int, q_len: int, num_heads: int, num_kv_heads: int, max_keys: int) -> int:
  """An upper bound of the split count the kernels pick (they size nothing past it)."""
  rows = q_len * (num_heads // num_kv_heads)
  heads = batch * num_kv_heads * math.ceil(rows / MAX_ROWS)
  by_slots = max(1, _MAX_BLOCKS_PER_SM * _sm_count() // heads)
  by_length = max(1, math.ceil(max_keys / _BLOCK_KEYS) // _MIN_TILES_PER_SPLIT)
  return min(by_slots, by_length, MAX_SPLITS)


def workspaces(batch: int, q_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
               max_keys: int, num_splits: int = 0) -> tuple[jax.ShapeDtypeStruct, ...]:
  """partial_out f32 [splits, B, T, N, H], partial_lse f32 [splits, B, N, T], counters s32
  [B * K * ceil(T * N/K / 16)]; splits = num_splits, or the automatic choice's bound when 0."""
  splits = num_splits or max_splits(batch, q_len, num_heads, num_kv_heads, max_keys)
  rows = q_len * (num_heads // num_kv_heads)
  counters = batch * num_kv_heads * math.ceil(rows / 16)
  return (jax.ShapeDtypeStruct((splits, batch, q_len, num_heads, head_dim), jnp.float32),
          jax.ShapeDtypeStruct((splits, batch, num_heads, q_len), jnp.float32),
          jax.ShapeDtypeStruct((counters,), jnp.int32))


def envelope(shape: AttentionShape, config: AttentionConfig) -> str | None:
  del config
  rows = shape.q_len * (shape.num_heads // shape.num_kv_heads)
  if rows > MAX_ROWS:
    return (f"T * N / K = {rows} query rows per kv head exceed {MAX_ROWS}: not a decode shape")
  return kernel_limits(shape.batch, shape.q_len, shape.num_heads, shape.num_kv_heads,
                       shape.head_dim, shape.kv_len)


def forward_workspaces(shape: AttentionShape, dtype):
  del dtype
  return workspaces(shape.batch, shape.q_len, shape.num_heads, shape.num_kv_heads,
                    shape.head_dim, shape.kv_len)


DECODE = register(Schedule(
    name="decode",
    description="split-KV Flash-Decoding for short queries: GQA rows packed per kv head, "
                "splits merged in-kernel (backward: v3's)",
    platform="gpu",
    forward_target="jax_flash_decode_fwd",
    **v3.BACKWARD,
    dtypes=frozenset({"bfloat16", "float16"}),
    max_head_dim=max(HEAD_DIMS),
    head_dim_multiple=1,
    supports_bias=False,
    supports_mask=False,
    supports_softcap=True,
    compute_capabilities=HOPPER,
    forward_workspaces=forward_workspaces,
    extra_check=envelope,
))
