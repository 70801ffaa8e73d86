"""The one place that calls the FFI targets (docs/architecture.md has the convention).

`forward` and `backward` take the seven standard inputs with absent bias / mask as None and
sequence lengths always present. Each is a `custom_vmap` function whose batching rule folds the
vmapped axis into the kernel's batch axis: a vmapped attention is one kernel launch over V*B
sequences, not a loop.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from jax_flash import sharding
from jax_flash._config import AttentionConfig, AttentionShape
from jax_flash.schedules.base import Schedule

_DUMMY_SHAPE = (1, 1, 1, 1)


def _attributes(config: AttentionConfig) -> dict:
  return dict(
      scale=np.float32(config.scale),
      softcap=np.float32(config.softcap),
      is_causal=bool(config.is_causal),
      window_left=np.int32(config.window_left),
      window_right=np.int32(config.window_right),
      has_bias=bool(config.has_bias),
      has_mask=bool(config.has_mask),
      deterministic=bool(config.deterministic),
  )


def _standard_inputs(q, k, v, bias, mask, q_seqlens, kv_seqlens):
  bias = jnp.zeros(_DUMMY_SHAPE, jnp.float32) if bias is None else bias.astype(jnp.float32)
  mask = jnp.ones(_DUMMY_SHAPE, jnp.bool_) if mask is None else mask
  return (q, k, v, bias, mask, q_seqlens.astype(jnp.int32), kv_seqlens.astype(jnp.int32))


def _raw_forward(schedule: Schedule, config: AttentionConfig, q, k, v, bias, mask, q_seqlens,
                 kv_seqlens):
  shape = AttentionShape.of(q, k)
  b, t, n, _ = q.shape
  outputs = (jax.ShapeDtypeStruct(q.shape, q.dtype),
             jax.ShapeDtypeStruct((b, n, t), jnp.float32),
             *schedule.forward_workspaces(shape, q.dtype))
  call = jax.ffi.ffi_call(schedule.forward_target, outputs)
  out, lse, *_ = call(*_standard_inputs(q, k, v, bias, mask, q_seqlens, kv_seqlens),
                      **_attributes(config))
  return out, lse


def _raw_backward(schedule: Schedule, config: AttentionConfig, q, k, v, bias, mask, q_seqlens,
                  kv_seqlens, out, lse, dout):
  shape = AttentionShape.of(q, k)
  b, t, n, _ = q.shape
  s = k.shape[1]
  dbias_shape = (b, n, t, s) if bias is not None else _DUMMY_SHAPE
  outputs = (jax.ShapeDtypeStruct(q.shape, q.dtype),
             jax.ShapeDtypeStruct(k.shape, k.dtype),
             jax.ShapeDtypeStruct(v.shape, v.dtype),
             jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
             *schedule.backward_workspaces(shape, q.dtype))
  call = jax.ffi.ffi_call(schedule.backward_target, outputs)
  dq, dk, dv, dbias, *_ = call(
      *_standard_inputs(q, k, v, bias, mask, q_seqlens, kv_seqlens), out, lse, dout,
      **_attributes(config))
  return dq, dk, dv, (dbias if bias is not None else None)


# Under a multi-device jit each call is a custom partitioning op (sharding.py). The partitioning
# sits inside the custom_vmap: the batching rule folds the vmapped axis first, then the folded
# call is partitioned (custom_partitioning has no batching rule of its own).
_partitioned_forward = sharding.partitioned(_raw_forward, "forward")
_partitioned_backward = sharding.partitioned(_raw_backward, "backward")


# -- batching: fold the vmapped axis into the batch axis ---------------------------------------

# Positions of bias and mask among the standard inputs: 4-D, batch dim 1 or B.
_BROADCAST_POSITIONS = (3, 4)


def _fold_batched(x, batched: bool, axis_size: int, batch: int, broadcastable: bool):
  """[V, B, ...] (or unbatched [B, ...]) -> [V*B, ...]. An unbatched bias / mask whose batch
  dim is 1 is left as it is: it still broadcasts over the V*B folded sequences."""
  if x is None:
    return None
  if not batched:
    if broadcastable and x.shape[0] == 1:
      return x
    x = jnp.broadcast_to(x, (axis_size,) + x.shape)
  if x.shape[1] != batch:  # a vmapped bias / mask with a broadcast batch dim
    x = jnp.broadcast_to(x, (axis_size, batch) + x.shape[2:])
  return x.reshape((axis_size * batch,) + x.shape[2:])


def _unfold(x, axis_size: int):
  if x is None:
    return None
  return x.reshape((axis_size, x.shape[0] // axis_size) + x.shape[1:])


def _folded_call(raw, schedule, config, axis_size, in_batched, args):
  q, q_batched = args[0], in_batched[0]
  batch = q.shape[1] if q_batched else q.shape[0]
  folded = [_fold_batched(x, bool(bt), axis_size, batch, i in _BROADCAST_POSITIONS)
            for i, (x, bt) in enumerate(zip(args, in_batched))]
  results = raw(schedule, config, *folded)
  unfolded = tuple(_unfold(r, axis_size) for r in results)
  return unfolded, tuple(None if r is None else True for r in results)


@functools.lru_cache(maxsize=None)
def _vmappable(raw, schedule: Schedule, config: AttentionConfig):
  @custom_vmap
  def call(*args):
    return raw(schedule, config, *args)

  @call.def_vmap
  def _rule(axis_size, in_batched, *args):
    return _folded_call(raw, schedule, config, axis_size, in_batched, args)

  return call


def forward(schedule: Schedule, config: AttentionConfig, q, k, v, bias, mask, q_seqlens,
            kv_seqlens):
  """(out [B,T,N,H], lse f32 [B,N,T])."""
  return _vmappable(_partitioned_forward, schedule, config)(
      q, k, v, bias, mask, q_seqlens, kv_seqlens)


def backward(schedule: Schedule, config: AttentionConfig, q, k, v, bias, mask, q_seqlens,
             kv_seqlens, out, lse, dout):
  """(dq, dk, dv, dbias full f32 [B,N,T,S] or None)."""
  return _vmappable(_partitioned_backward, schedule, config)(
      q, k, v, bias, mask, q_seqlens, kv_seqlens, out, lse, dout)
