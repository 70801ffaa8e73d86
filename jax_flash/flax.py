"""Flax integration: an `attention_fn` for Flax's attention modules, and modules of our own.

  flax.linen.MultiHeadDotProductAttention(..., attention_fn=jax_flash.flax.attention_fn)
  flax.nnx.MultiHeadAttention(..., attention_fn=jax_flash.flax.attention_fn, rngs=...)
  jax_flash.flax.LinenFlashAttention / NnxFlashAttention: multi-head attention with GQA
      (num_kv_heads), a causal option, softcap, sliding window, sequence lengths.

Differences from Flax's dot_product_attention, all deliberate:
- dropout on the attention probabilities is not implemented by the kernels: a call that would
  apply it (dropout_rate > 0 and deterministic=False) raises ValueError instead of silently
  running without it. Dropout elsewhere in a model is unaffected.
- the probabilities are never materialized, so `sow_weights=True` and Flax's quantized einsum
  hooks (qk_attn_weights_einsum, attn_weights_value_einsum) raise ValueError.
- a query row with no key left by the mask gives 0 (Flax gives the mean of the values).
- the softmax always runs in float32 (force_fp32_for_softmax is always honoured) and the
  kernels accumulate in float32 whatever `precision` says.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen
import jax
import jax.numpy as jnp
from flax import nnx

from jax_flash.api import flash_attention

Array = jax.Array


def attention_fn(query, key, value, bias=None, mask=None, *, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, force_fp32_for_softmax=False,
                 qk_attn_weights_einsum=None, attn_weights_value_einsum=None, is_causal=False,
                 scale=None, softcap=None, query_seq_lengths=None, key_value_seq_lengths=None,
                 local_window_size=None, schedule="auto"):
  """Drop-in for `flax.linen.dot_product_attention` / `flax.nnx.dot_product_attention`.

  query [batch..., T, N, H], key / value [batch..., S, K, H] (K may divide N: GQA);
  bias / mask broadcastable to [batch..., N, T, S]; like Flax, a mask entry keeps its score when
  it is nonzero (Flax's masks are often float 0/1). The keyword arguments after `is_causal` are
  jax_flash's (see `jax_flash.flash_attention`); bind them with functools.partial to use them
  from a Flax module.
  """
  del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
  _refuse_unsupported(dropout_rate, deterministic, module, qk_attn_weights_einsum,
                      attn_weights_value_einsum)
  dtype = dtype or jnp.result_type(query, key, value)
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  batch_shape = query.shape[:-3]
  if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
    raise ValueError(f"key and value must share the batch dims {batch_shape} of query; got "
                     f"key {key.shape}, value {value.shape}")
  fold = lambda x: x.reshape((math.prod(batch_shape),) + x.shape[-3:])
  mask = None if mask is None else mask.astype(bool)
  out = flash_attention(
      fold(query), fold(key), fold(value), _fold_scores(bias, batch_shape, "bias"),
      _fold_scores(mask, batch_shape, "mask"), scale=scale, is_causal=is_causal,
      query_seq_lengths=_fold_lengths(query_seq_lengths, batch_shape),
      key_value_seq_lengths=_fold_lengths(key_value_seq_lengths, batch_shape),
      local_window_size=local_window_size, softcap=softcap, schedule=schedule)
  return out.reshape(batch_shape + out.shape[1:])


def _refuse_unsupported(dropout_rate, deterministic, module, qk_einsum, value_einsum):
  if dropout_rate and not deterministic:
    raise ValueError(
        f"dropout_rate={dropout_rate} with deterministic=False: jax_flash does not implement "
        "dropout on attention probabilities. Pass deterministic=True (e.g. at evaluation), "
        "set the attention dropout_rate to 0, or use Flax's own dot_product_attention.")
  if module is not None:
    raise ValueError("sow_weights=True (module given): flash attention never materializes the "
                     "attention weights, so it cannot sow them")
  if qk_einsum is not None or value_einsum is not None:
    raise ValueError("qk_attn_weights_einsum / attn_weights_value_einsum are not supported: "
                     "the kernel computes both products itself")


def _fold_scores(x, batch_shape: tuple, name: str):
  """[batch..., N, T, S] (numpy-broadcastable) -> [B or 1, N, T, S]."""
  if x is None:
    return None
  rank = len(batch_shape) + 3
  if x.ndim > rank:
    raise ValueError(f"{name} has rank {x.ndim}; at most {rank} ([batch..., N, T, S]) allowed")
  x = x.reshape((1,) * (rank - x.ndim) + x.shape)
  lead = x.shape[:len(batch_shape)]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + x.shape[len(batch_shape):])
  x = jnp.broadcast_to(x, batch_shape + x.shape[len(batch_shape):])
  return x.reshape((math.prod(batch_shape),) + x.shape[len(batch_shape):])


def _fold_lengths(lengths, batch_shape: tuple):
  if lengths is None:
    return None
  return jnp.broadcast_to(lengths, batch_shape).reshape(-1)


# -- modules ------------------------------------------------------------------------------------

def _attend(module, q, k, v, mask, bias, query_seq_lengths, key_value_seq_lengths):
  return attention_fn(q, k, v, bias, mask, dtype=module.dtype, is_causal=module.is_causal,
                      softcap=module.softcap, local_window_size=module.local_window_size,
                      query_seq_lengths=query_seq_lengths,
                      key_value_seq_lengths=key_value_seq_lengths, schedule=module.schedule)


def _heads(num_heads: int, num_kv_heads: int | None) -> int:
  kv = num_heads if num_kv_heads is None else num_kv_heads
  if kv < 1 or num_heads % kv:
    raise ValueError(f"num_kv_heads must divide num_heads={num_heads}; got {num_kv_heads}")
  return kv


class LinenFlashAttention(flax.linen.Module):
  """Multi-head attention (Flax linen) on the flash kernels, with GQA.

  inputs_q [batch..., T, features] (and inputs_kv [batch..., S, features], default inputs_q)
  -> [batch..., T, out_features]. Query heads `num_heads`, key/value heads `num_kv_heads`
  (default num_heads; must divide it); each of head_dim (default features // num_heads).
  """
  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  out_features: int | None = None
  is_causal: bool = False
  softcap: float | None = None
  local_window_size: Any = None
  use_bias: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = flax.linen.initializers.lecun_normal()
  schedule: str = "auto"

  @flax.linen.compact
  def __call__(self, inputs_q, inputs_kv=None, *, mask=None, bias=None, query_seq_lengths=None,
               key_value_seq_lengths=None):
    inputs_kv = inputs_q if inputs_kv is None else inputs_kv
    features = inputs_q.shape[-1]
    head_dim = self.head_dim or features // self.num_heads
    kv_heads = _heads(self.num_heads, self.num_kv_heads)
    dense = lambda heads, name: flax.linen.DenseGeneral(
        (heads, head_dim), use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init, name=name)
    q = dense(self.num_heads, "query")(inputs_q)
    k = dense(kv_heads, "key")(inputs_kv)
    v = dense(kv_heads, "value")(inputs_kv)
    x = _attend(self, q, k, v, mask, bias, query_seq_lengths, key_value_seq_lengths)
    return flax.linen.DenseGeneral(
        self.out_features or features, axis=(-2, -1), use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init, name="out")(x)


class NnxFlashAttention(nnx.Module):
  """Multi-head attention (Flax NNX) on the flash kernels, with GQA; see LinenFlashAttention."""

  def __init__(self, in_features: int, num_heads: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, out_features: int | None = None,
               is_causal: bool = False, softcap: float | None = None, local_window_size=None,
               use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(), schedule: str = "auto",
               rngs: nnx.Rngs):
    head_dim = head_dim or in_features // num_heads
    kv_heads = _heads(num_heads, num_kv_heads)
    self.is_causal, self.softcap, self.schedule = is_causal, softcap, schedule
    self.local_window_size, self.dtype = local_window_size, dtype
    linear = lambda heads: nnx.LinearGeneral(
        in_features, (heads, head_dim), use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        kernel_init=kernel_init, rngs=rngs)
    self.query, self.key, self.value = linear(num_heads), linear(kv_heads), linear(kv_heads)
    self.out = nnx.LinearGeneral(
        (num_heads, head_dim), out_features or in_features, axis=(-2, -1), use_bias=use_bias,
        dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)

  def __call__(self, inputs_q, inputs_kv=None, *, mask=None, bias=None, query_seq_lengths=None,
               key_value_seq_lengths=None):
    inputs_kv = inputs_q if inputs_kv is None else inputs_kv
    q, k, v = self.query(inputs_q), self.key(inputs_kv), self.value(inputs_kv)
    x = _attend(self, q, k, v, mask, bias, query_seq_lengths, key_value_seq_lengths)
    return self.out(x)
