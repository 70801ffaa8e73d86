"""Argument checks for flash_attention. Every failure is a ValueError that names the argument and
says what was expected; all of it runs at trace time on shapes and dtypes only."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash._config import AttentionConfig, AttentionShape

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
MAX_HEAD_DIM = 256


def _shape_str(x) -> str:
  return "[" + ", ".join(str(d) for d in x.shape) + "]"


def check_qkv(query, key, value) -> AttentionShape:
  for name, x in (("query", query), ("key", key), ("value", value)):
    if getattr(x, "ndim", None) != 4:
      layout = "[B, T, N, H]" if name == "query" else "[B, S, K, H]"
      raise ValueError(f"{name} must be a 4-D array {layout} (BTNH layout); got shape "
                       f"{getattr(x, 'shape', type(x).__name__)}")
    if jnp.dtype(x.dtype).name not in FLOAT_DTYPES:
      raise ValueError(f"{name} dtype must be one of {FLOAT_DTYPES}; got {jnp.dtype(x.dtype).name}")
  if not (query.dtype == key.dtype == value.dtype):
    raise ValueError(f"query, key and value must share one dtype; got {query.dtype}, "
                     f"{key.dtype}, {value.dtype}")
  b, t, n, h = query.shape
  if key.shape != value.shape:
    raise ValueError(f"value must have the shape of key {_shape_str(key)}; got {_shape_str(value)}")
  if key.shape[0] != b:
    raise ValueError(f"key batch size must equal query's ({b}); got key shape {_shape_str(key)}")
  if key.shape[3] != h:
    raise ValueError(f"key head dim must equal query's ({h}); got key shape {_shape_str(key)}")
  k = key.shape[2]
  if k == 0 or n % k != 0:
    raise ValueError(f"key heads K={k} must divide query heads N={n} (GQA/MQA); got query "
                     f"{_shape_str(query)}, key {_shape_str(key)}")
  if h < 1 or h > MAX_HEAD_DIM:
    raise ValueError(f"query head dim H must be in [1, {MAX_HEAD_DIM}]; got {h}")
  return AttentionShape.of(query, key)


def check_broadcast_4d(name: str, x, shape: AttentionShape):
  if x is None:
    return
  full = (shape.batch, shape.num_heads, shape.q_len, shape.kv_len)
  if getattr(x, "ndim", None) != 4 or any(d not in (1, f) for d, f in zip(x.shape, full)):
    raise ValueError(f"{name} must be 4-D and broadcastable to [B, N, T, S] = {list(full)} "
                     f"(each dim 1 or full); got shape {getattr(x, 'shape', None)}")
  if name == "mask" and jnp.dtype(x.dtype) != jnp.bool_:
    raise ValueError(f"mask must be a boolean array (True = keep); got dtype {x.dtype}")
  if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"bias must be a floating array; got dtype {x.dtype}")


def check_seq_lengths(name: str, x, batch: int, optional: bool = True):
  """An integer [B] array (None allowed when optional). Its values are data, not trace-time
  facts: the kernels clip lengths to the sequence length."""
  if x is None and optional:
    return
  if getattr(x, "shape", None) != (batch,) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape [B] = [{batch}]; got "
                     f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}")


def window_sides(local_window_size) -> tuple[int, int]:
  """(left, right) with -1 for 'unbounded'; jax.nn semantics: an int w means (w, w)."""
  if local_window_size is None:
    return -1, -1
  if isinstance(local_window_size, (int, np.integer)):
    sides = (int(local_window_size), int(local_window_size))
  elif (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
        and all(isinstance(w, (int, np.integer)) for w in local_window_size)):
    sides = (int(local_window_size[0]), int(local_window_size[1]))
  else:
    raise ValueError("local_window_size must be an int or a (left, right) pair of ints; got "
                     f"{local_window_size!r}")
  if min(sides) < 0:
    raise ValueError(f"local_window_size sides must be >= 0; got {local_window_size!r}")
  return sides


def resolve_scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(scale, (jnp.ndarray, np.ndarray)) and np.ndim(scale) != 0:
    raise ValueError(f"scale must be a Python float; got an array of shape {np.shape(scale)}")
  try:
    value = float(scale)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"scale must be a concrete Python float (it is a kernel constant); got "
                     f"{type(scale).__name__}") from e
  if not math.isfinite(value):
    raise ValueError(f"scale must be finite; got {value}")
  return value


def resolve_softcap(softcap) -> float:
  if softcap is None:
    return 0.0
  try:
    value = float(softcap)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(f"softcap must be a positive Python float or None; got "
                     f"{type(softcap).__name__}") from e
  if not (value > 0 and math.isfinite(value)):
    raise ValueError(f"softcap must be a positive finite float or None; got {softcap!r}")
  return value


def build_config(query, key, value, bias, mask, *, scale, is_causal, query_seq_lengths,
                 key_value_seq_lengths, local_window_size, softcap, deterministic=False
                 ) -> tuple[AttentionShape, AttentionConfig]:
  shape = check_qkv(query, key, value)
  check_broadcast_4d("bias", bias, shape)
  check_broadcast_4d("mask", mask, shape)
  check_seq_lengths("query_seq_lengths", query_seq_lengths, shape.batch)
  check_seq_lengths("key_value_seq_lengths", key_value_seq_lengths, shape.batch)
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"is_causal must be a Python bool; got {type(is_causal).__name__}")
  if not isinstance(deterministic, (bool, np.bool_)):
    raise ValueError(f"deterministic must be a Python bool; got {type(deterministic).__name__}")
  left, right = window_sides(local_window_size)
  config = AttentionConfig(
      scale=resolve_scale(scale, shape.head_dim),
      softcap=resolve_softcap(softcap),
      is_causal=bool(is_causal),
      window_left=left,
      window_right=right,
      has_bias=bias is not None,
      has_mask=mask is not None,
      deterministic=bool(deterministic),
  )
  return shape, config
