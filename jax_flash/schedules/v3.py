"""The v3 schedule: the Hopper (sm_90a) kernels of cuda/v3_fwd_sm90.cu and cuda/v3_bwd_sm90.cu.

Forward: TMA loads into a multi-stage shared-memory ring, wgmma for QK^T and PV, a producer
warpgroup and register-reallocated consumer warpgroups (pingpong between them), a persistent
grid. Backward: a preprocessing kernel (D, lse in log2 units, clears the dQ accumulator), a
warp-specialized main kernel (TMA producer; two wgmma consumer warpgroups keep dK / dV in
registers over every query block and every query head of the GQA group: at head dims 64 / 128
each owns 64 keys, at 256 they split the head dim of a 64-key block; dQ partials added into an
fp32 accumulator by TMA bulk reduce-add, or vector reductions at 256) and a dQ conversion kernel.

Envelope: bfloat16 / float16, head dims 64, 128 and 256 (others go to v2 through the dispatch
order), causal, sliding window, GQA / MQA, q / kv sequence lengths, softcap. Bias and mask
tensors are declared unsupported here, so the dispatch sends those calls to v2. The backward
covers the forward's whole envelope.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._config import AttentionConfig, AttentionShape
from jax_flash.schedules.base import HOPPER, Schedule, register

HEAD_DIMS = (64, 128, 256)
_ROW_PAD = 128         # kRowPad in cuda/v3_bwd_sm90.cu
_SEMAPHORE_ROWS = 64   # query rows per dQ semaphore (kDqTileRows)
# The GQA split of the backward (V3BackwardMaxKvSplit in cuda/v3_bwd_sm90.cu): considered when
# heads_per_kv > 1 and key blocks x kv heads x batch < _SPLIT_CTAS_PER_SM x _SPLIT_SM_COUNT.
_MAX_KV_SPLIT = 4          # kMaxKvSplit (splits are powers of two)
_SPLIT_SM_COUNT = 132      # kWorkspaceSmCount: the most SMs of an sm_90 part
_SPLIT_CTAS_PER_SM = 4     # kGqaMaxCtasPerSm
# The default grid's key blocks cut into CTAs (V3BackwardMaxBlockParts): below _SPLIT_SM_COUNT
# CTAs, at most _MAX_BLOCK_PARTS each.
_MAX_BLOCK_PARTS = 4       # kMaxBlockParts


def _envelope(shape: AttentionShape, config: AttentionConfig) -> str | None:
  if shape.head_dim not in HEAD_DIMS:
    return f"head dim {shape.head_dim} is not one of {HEAD_DIMS}"
  if not config.scale > 0:
    return "scale must be > 0"
  if shape.kv_len < 1:
    return "needs at least one key"
  return None


def _key_block(shape: AttentionShape) -> int:
  return 64 if shape.head_dim > 128 else 128


def _default_grid_ctas(shape: AttentionShape) -> int:
  """CTAs of the backward's default grid: key blocks x kv heads x batch."""
  return -(-shape.kv_len // _key_block(shape)) * shape.num_kv_heads * shape.batch


def max_kv_split(shape: AttentionShape) -> int:
  """V3BackwardMaxKvSplit (cuda/v3.h): the most CTAs the backward may split a kv head's query
  heads over (1: never). Key blocks are 128 keys (64 at head dim 256)."""
  if shape.num_kv_heads <= 0 or shape.num_heads <= shape.num_kv_heads:
    return 1
  if _default_grid_ctas(shape) >= _SPLIT_CTAS_PER_SM * _SPLIT_SM_COUNT:
    return 1
  group = shape.num_heads // shape.num_kv_heads
  split = _MAX_KV_SPLIT
  while split > 1 and group % split:
    split //= 2
  return split


def max_block_parts(shape: AttentionShape) -> int:
  """V3BackwardMaxBlockParts (cuda/v3.h): the most CTAs the backward may cut a key block of its
  default grid into (1: never), when that grid has fewer CTAs than SMs."""
  return _MAX_BLOCK_PARTS if _default_grid_ctas(shape) < _SPLIT_SM_COUNT else 1


def backward_workspaces(shape: AttentionShape, dtype):
  """The outputs V3BackwardWorkspaceSizes(shape, deterministic=true) sizes (cuda/v3.h), with
  T_pad = T rounded up to 128: dq_accum f32 [B, N, T_pad, H], dsum and lse_log2 f32
  [B, N, T_pad], dq_semaphore s32 [B * N * T_pad / 64] (read only in deterministic mode; one
  size keeps the workspaces independent of the attribute), dkv_partial f32
  [2 * s * B * S * K * H] with s = max(max_kv_split(shape), max_block_parts(shape)) when s > 1,
  else f32 [1] (the fp32 dK / dV partials of the GQA split or of key blocks cut into parts)."""
  del dtype
  b, n, h = shape.batch, shape.num_heads, shape.head_dim
  t_pad = -(-shape.q_len // _ROW_PAD) * _ROW_PAD
  rows = jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32)
  slots = max(max_kv_split(shape), max_block_parts(shape))
  partial = (2 * slots * b * shape.kv_len * shape.num_kv_heads * h) if slots > 1 else 1
  return (jax.ShapeDtypeStruct((b, n, t_pad, h), jnp.float32), rows, rows,
          jax.ShapeDtypeStruct((b * n * t_pad // _SEMAPHORE_ROWS,), jnp.int32),
          jax.ShapeDtypeStruct((partial,), jnp.float32))


# The Schedule fields of the v3 backward: the v3 schedule's, and the decode schedule's too.
BACKWARD = dict(
    backward_target="jax_flash_v3_bwd",
    backward_workspaces=backward_workspaces,
    backward_determinism="on_request",
)

V3 = register(Schedule(
    name="v3",
    description="Hopper: TMA + wgmma, warp-specialized; forward pingpong on a persistent grid, "
                "backward with dK/dV in registers",
    platform="gpu",
    forward_target="jax_flash_v3_fwd",
    **BACKWARD,
    dtypes=frozenset({"bfloat16", "float16"}),
    max_head_dim=256,
    supports_bias=False,
    supports_mask=False,
    supports_softcap=True,
    compute_capabilities=HOPPER,
    extra_check=_envelope,
))
